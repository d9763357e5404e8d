//! `tablemail template list | show | put | render` (DESIGN §15): the
//! templates in the database, written and tried out from the shell.

use std::{io::Read, path::Path};

use crate::{
    cli::TemplateCommand,
    config::Settings,
    store::NewTemplate,
    templates::{Catalog, Request},
};

use super::{connect, message_defaults, CommandError, Result};

/// `--data`: a JSON object.
pub(super) fn parse_data(data: &str) -> Result<serde_json::Map<String, serde_json::Value>> {
    match serde_json::from_str(data) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err(CommandError::Usage("--data: expected a JSON object".into())),
        Err(e) => Err(CommandError::Usage(format!("--data: {e}"))),
    }
}

/// A part of a template from a file, or from stdin for `-`.
fn read_part(path: &Path) -> Result<String> {
    let mut text = String::new();
    let read = match path.as_os_str() == "-" {
        true => std::io::stdin().read_to_string(&mut text).map(|_| ()),
        false => std::fs::read_to_string(path).map(|t| text = t),
    };
    read.map_err(|e| CommandError::Usage(format!("{}: {e}", path.display())))?;
    Ok(text)
}

pub(super) async fn template(settings: &Settings, command: TemplateCommand) -> Result<()> {
    let store = connect(settings).await?;
    match command {
        TemplateCommand::List => {
            for t in store.templates().await? {
                println!(
                    "{:<32} {:<8} {}  subject {} B, text {} B, html {} B",
                    t.name,
                    if t.locale.is_empty() { "''" } else { &t.locale },
                    t.updated_at.format("%Y-%m-%dT%H:%M:%SZ"),
                    t.subject.len(),
                    t.body.as_deref().map_or(0, str::len),
                    t.body_html.as_deref().map_or(0, str::len),
                );
            }
            Ok(())
        }
        TemplateCommand::Show { name, locale } => {
            let rows = store.templates().await?;
            let Some(t) = crate::templates::pick(&rows, &name, &locale) else {
                return Err(CommandError::Runtime(format!(
                    "template {name:?} does not exist (locale {locale:?} or a fallback)"
                )));
            };
            println!("name: {}", t.name);
            println!("locale: {:?}", t.locale);
            println!(
                "updated_at: {}",
                t.updated_at.format("%Y-%m-%dT%H:%M:%S%.3fZ")
            );
            println!("subject: {}", t.subject);
            for (label, part) in [("text", &t.body), ("html", &t.body_html)] {
                if let Some(part) = part {
                    println!("--- {label}\n{part}");
                }
            }
            Ok(())
        }
        TemplateCommand::Put {
            name,
            locale,
            subject,
            text,
            html,
        } => {
            if name.trim().is_empty() {
                return Err(CommandError::Usage("a template needs a name".into()));
            }
            let template = NewTemplate {
                body: text.as_deref().map(read_part).transpose()?,
                body_html: html.as_deref().map(read_part).transpose()?,
                name,
                locale,
                subject,
            };
            // A template that does not compile is refused, not stored.
            let mut rows = store.templates().await?;
            rows.retain(|t| !(t.name == template.name && t.locale == template.locale));
            rows.push(crate::store::TemplateRow {
                name: template.name.clone(),
                locale: template.locale.clone(),
                subject: template.subject.clone(),
                body: template.body.clone(),
                body_html: template.body_html.clone(),
                updated_at: chrono::Utc::now(),
            });
            if let Some(reason) =
                Catalog::from_rows(&rows).compile_error(&template.name, &template.locale)
            {
                return Err(CommandError::Usage(reason));
            }
            store.put_template(&template).await?;
            println!("{} {:?}", template.name, template.locale);
            Ok(())
        }
        TemplateCommand::Render { name, data, locale } => {
            let defaults = message_defaults(settings)?;
            let data = serde_json::Value::Object(parse_data(&data)?).to_string();
            let catalog = Catalog::from_rows(&store.templates().await?);
            let rendered = catalog
                .render(&Request {
                    name: &name,
                    locale: Some(&locale),
                    data: Some(&data),
                    subject: true,
                    text: true,
                    html: true,
                    max_output: defaults.max_message_size,
                })
                .map_err(|e| CommandError::Runtime(e.to_string()))?;
            println!("locale: {:?}", rendered.locale);
            println!("subject: {}", rendered.subject.unwrap_or_default());
            for (label, part) in [("text", rendered.text), ("html", rendered.html)] {
                if let Some(part) = part {
                    println!("--- {label}\n{part}");
                }
            }
            Ok(())
        }
    }
}
