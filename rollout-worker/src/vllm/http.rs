//! A small HTTP/1.1 client for the engine's API over its Unix socket.
//!
//! The engine listens on a Unix socket in a directory only this process's user can enter, not on
//! a TCP port: its development endpoints (weight reloads, pause, `collective_rpc`) carry no
//! authentication, and a loopback port would hand them to every local user. One connection per
//! call keeps the client trivial; the calls are few and large (a whole sample, a weight reload),
//! so the connect costs nothing measurable.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::UnixStream;

/// Why a call to the engine failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The engine could not be reached or dropped the connection (it is starting, stopped or
    /// died): the caller may retry once it is up again.
    #[error("engine unreachable: {0}")]
    Unreachable(String),
    /// The engine answered with an error status.
    #[error("engine answered {status} to {path}: {body}")]
    Status {
        /// The HTTP status.
        status: u16,
        /// The endpoint.
        path: String,
        /// The body (vLLM's error JSON, as text).
        body: String,
    },
    /// The answer was not the JSON expected.
    #[error("engine's answer to {path} is not valid: {message}")]
    Invalid {
        /// The endpoint.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// No answer within the call's time limit.
    #[error("engine did not answer {path} within {secs} s")]
    Timeout {
        /// The endpoint.
        path: String,
        /// The limit.
        secs: u64,
    },
}

/// The engine's HTTP API at a Unix socket.
#[derive(Clone, Debug)]
pub struct EngineHttp {
    socket: PathBuf,
}

impl EngineHttp {
    /// The API served at `socket`.
    pub fn new(socket: &Path) -> Self {
        Self {
            socket: socket.to_path_buf(),
        }
    }

    /// `GET path`: the status and body.
    pub async fn get(&self, path: &str, timeout: Duration) -> Result<(u16, Bytes), CallError> {
        self.call(hyper::Method::GET, path, None, timeout).await
    }

    /// `POST path` with a JSON body (or none), expecting a 2xx answer; the answer as JSON (`Null`
    /// for an empty body).
    pub async fn post_json(
        &self,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<Value, CallError> {
        let bytes = self.post(path, body, timeout).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&bytes).map_err(|e| CallError::Invalid {
            path: path.to_string(),
            message: e.to_string(),
        })
    }

    /// POSTs `body` to `path`; the answer's bytes when its status is 2xx (some endpoints answer
    /// plain text).
    pub async fn post(
        &self,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<Bytes, CallError> {
        let payload = body.map(|b| Bytes::from(serde_json::to_vec(b).expect("a Value serialises")));
        let (status, bytes) = self
            .call(hyper::Method::POST, path, payload, timeout)
            .await?;
        if !(200..300).contains(&status) {
            return Err(CallError::Status {
                status,
                path: path.to_string(),
                body: String::from_utf8_lossy(&bytes).chars().take(2000).collect(),
            });
        }
        Ok(bytes)
    }

    async fn call(
        &self,
        method: hyper::Method,
        path: &str,
        body: Option<Bytes>,
        timeout: Duration,
    ) -> Result<(u16, Bytes), CallError> {
        let work = async {
            let stream = UnixStream::connect(&self.socket)
                .await
                .map_err(|e| CallError::Unreachable(format!("{}: {e}", self.socket.display())))?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|e| CallError::Unreachable(format!("handshake: {e}")))?;
            // The connection is driven beside the request; it is closed when the answer is read or
            // the caller gives up (a cancelled job: vLLM aborts a request whose client is gone).
            let _driver = AbortOnDrop(tokio::spawn(conn));
            let mut req = hyper::Request::builder()
                .method(method)
                .uri(path)
                .header(hyper::header::HOST, "localhost");
            if body.is_some() {
                req = req.header(hyper::header::CONTENT_TYPE, "application/json");
            }
            let req = req
                .body(Full::new(body.unwrap_or_default()))
                .expect("a valid request");
            let answer = sender
                .send_request(req)
                .await
                .map_err(|e| CallError::Unreachable(format!("{path}: {e}")));

            match answer {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    resp.into_body()
                        .collect()
                        .await
                        .map(|b| (status, b.to_bytes()))
                        .map_err(|e| {
                            CallError::Unreachable(format!("{path}: reading the answer: {e}"))
                        })
                }
                Err(e) => Err(e),
            }
        };
        tokio::time::timeout(timeout, work)
            .await
            .map_err(|_| CallError::Timeout {
                path: path.to_string(),
                secs: timeout.as_secs(),
            })?
    }
}

/// Aborts a task when dropped (a plain `JoinHandle` detaches it).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
