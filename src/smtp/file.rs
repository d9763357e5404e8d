//! The file transport, for development: each mail becomes `<id>.eml` in a
//! directory, and nothing leaves the machine.

use std::{io, path::PathBuf};

use super::{
    error::{Delivered, SendError, Stage},
    Outgoing,
};

pub struct FileTransport {
    pub(super) dir: PathBuf,
}

impl FileTransport {
    pub(super) async fn send(&self, mail: Outgoing<'_>) -> Result<Delivered, SendError> {
        let down = |e: io::Error| {
            SendError::broke(
                Stage::Outbox,
                format!("cannot write to {}: {e}", self.dir.display()),
            )
        };
        self.create_dir().await?;
        // Written aside, then renamed: a reader never sees half a file.
        let tmp = self.dir.join(format!(".{}.eml.tmp", mail.id));
        let path = self.dir.join(format!("{}.eml", mail.id));
        tokio::fs::write(&tmp, mail.content).await.map_err(down)?;
        tokio::fs::rename(&tmp, &path).await.map_err(down)?;
        Ok(Delivered {
            relay: Default::default(),
            code: 250,
            reply: format!("written to {}", path.display()),
        })
    }

    pub(super) async fn create_dir(&self) -> Result<(), SendError> {
        tokio::fs::create_dir_all(&self.dir).await.map_err(|e| {
            SendError::broke(
                Stage::Outbox,
                format!("cannot create {}: {e}", self.dir.display()),
            )
        })
    }
}
