//! Name resolution for `PoolConfig::dns_names`, behind a trait so that a deployment (or a test) can
//! swap in its own discovery; the default asks the system resolver for A and AAAA records.

use std::fmt::Debug;
use std::net::SocketAddr;

use futures::future::BoxFuture;

/// Resolves `host:port` to every address it currently names.
pub trait Resolve: Debug + Send + Sync {
    fn resolve<'a>(&'a self, name: &'a str) -> BoxFuture<'a, std::io::Result<Vec<SocketAddr>>>;
}

/// The system resolver (`getaddrinfo`: /etc/hosts, then DNS), IPv4 and IPv6 alike.
#[derive(Debug, Default)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve<'a>(&'a self, name: &'a str) -> BoxFuture<'a, std::io::Result<Vec<SocketAddr>>> {
        Box::pin(async move {
            let mut addrs: Vec<SocketAddr> = tokio::net::lookup_host(name).await?.collect();
            addrs.sort();
            addrs.dedup();
            Ok(addrs)
        })
    }
}

/// The pool's address of a resolved worker: `http://1.2.3.4:p` or `http://[::1]:p`.
pub fn worker_address(addr: &SocketAddr) -> String {
    format!("http://{addr}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_addresses_are_bracketed() {
        assert_eq!(
            worker_address(&"[::1]:50061".parse().unwrap()),
            "http://[::1]:50061"
        );
        assert_eq!(
            worker_address(&"10.0.0.7:1".parse().unwrap()),
            "http://10.0.0.7:1"
        );
    }

    #[tokio::test]
    async fn localhost_resolves() {
        let addrs = SystemResolver.resolve("localhost:80").await.unwrap();
        assert!(
            addrs.iter().all(|a| a.ip().is_loopback() && a.port() == 80),
            "{addrs:?}"
        );
    }
}
