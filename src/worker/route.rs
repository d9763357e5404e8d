//! Routes (DESIGN §13): the relays mail leaves through. The default route
//! is `transport.*`; each `[[routes]]` table adds one, taken by a mail whose
//! From domain is one of its `from_domains` (or below one; the first that
//! matches wins) or whose row names it in `route`. Each route has its own
//! connections, relay gate (pause, probe, health) and domain throttling, so
//! one relay that is down or slow holds up only its own mail.

use std::sync::Arc;

use crate::smtp::Transport;

use super::{pace::Throttles, relay::RelayGate};

/// One relay (with its fallback) and what the daemon knows of it.
pub struct Route {
    /// `None`: the default route, `transport.*`.
    pub name: Option<String>,
    /// Lower-cased, without a trailing dot.
    from_domains: Vec<String>,
    pub transport: Arc<Transport>,
    pub relay: RelayGate,
    pub throttles: Throttles,
}

impl Route {
    pub fn new(name: Option<String>, from_domains: &[String], transport: Arc<Transport>) -> Route {
        Route {
            name,
            from_domains: from_domains
                .iter()
                .map(|d| d.trim_end_matches('.').to_ascii_lowercase())
                .collect(),
            transport,
            relay: RelayGate::default(),
            throttles: Throttles::default(),
        }
    }

    /// Its name in logs, metrics and pages: `default` for `transport.*`.
    pub fn label(&self) -> &str {
        self.name.as_deref().unwrap_or("default")
    }

    fn covers(&self, domain: &str) -> bool {
        self.from_domains.iter().any(|d| {
            domain == d
                || domain
                    .strip_suffix(d.as_str())
                    .is_some_and(|rest| rest.ends_with('.'))
        })
    }
}

/// Every route, the default first.
pub struct Routes(Vec<Route>);

/// The route of a mail, by its place in [`Routes`].
pub type RouteId = usize;

impl Routes {
    /// The default route alone.
    pub fn single(transport: Arc<Transport>) -> Routes {
        Routes(vec![Route::new(None, &[], transport)])
    }

    /// The default route (`transport.*`) and the named ones, in the order
    /// of the configuration.
    pub fn new(default: Arc<Transport>, named: Vec<Route>) -> Routes {
        let mut routes = vec![Route::new(None, &[], default)];
        routes.extend(named);
        Routes(routes)
    }

    pub fn get(&self, id: RouteId) -> &Route {
        &self.0[id]
    }

    pub fn default_route(&self) -> &Route {
        &self.0[0]
    }

    pub fn iter(&self) -> impl Iterator<Item = (RouteId, &Route)> {
        self.0.iter().enumerate()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Never: the default route is always there.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The route a mail takes: the one its row names, else the first whose
    /// domains cover its From domain, else the default. `Err(name)`: the
    /// row names a route no configuration has.
    pub fn pick(&self, named: Option<&str>, from_domain: Option<&str>) -> Result<RouteId, String> {
        if let Some(name) = named.map(str::trim).filter(|n| !n.is_empty()) {
            return self
                .0
                .iter()
                .position(|r| r.name.as_deref() == Some(name))
                .ok_or_else(|| name.to_string());
        }
        let Some(domain) = from_domain else {
            return Ok(0);
        };
        let domain = domain.trim_end_matches('.').to_ascii_lowercase();
        Ok(self
            .0
            .iter()
            .skip(1)
            .position(|r| r.covers(&domain))
            .map_or(0, |i| i + 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::smtp::{RelayOptions, TransportKind};

    fn transport() -> Arc<Transport> {
        Arc::new(
            Transport::new(RelayOptions {
                kind: TransportKind::parse("file:///tmp/none").unwrap(),
                username: None,
                password: None,
                oauth2: None,
                hello: "t".into(),
                timeout: std::time::Duration::from_secs(1),
                data_timeout: std::time::Duration::from_secs(1),
                pool_size: 1,
                accept_invalid_certs: false,
                allow_plaintext_auth: false,
            })
            .unwrap(),
        )
    }

    #[test]
    fn a_mail_takes_its_rows_route_else_its_from_domains_else_the_default() {
        let routes = Routes::new(
            transport(),
            vec![
                Route::new(Some("shop".into()), &["shop.example".into()], transport()),
                Route::new(
                    Some("support".into()),
                    &["Support.Example.".into(), "shop.example".into()],
                    transport(),
                ),
            ],
        );
        assert_eq!(routes.pick(None, Some("shop.example")), Ok(1));
        assert_eq!(routes.pick(None, Some("eu.SHOP.example")), Ok(1));
        assert_eq!(routes.pick(None, Some("support.example")), Ok(2));
        assert_eq!(routes.pick(None, Some("example.org")), Ok(0));
        assert_eq!(routes.pick(None, Some("notshop.example")), Ok(0));
        assert_eq!(routes.pick(None, None), Ok(0));
        assert_eq!(routes.pick(Some("support"), Some("shop.example")), Ok(2));
        assert_eq!(routes.pick(Some(" "), Some("shop.example")), Ok(1));
        assert_eq!(routes.pick(Some("billing"), None), Err("billing".into()));
        assert_eq!(routes.get(0).label(), "default");
    }
}
