//! List and watch of one Service's EndpointSlices, with every byte read
//! from the API bounded: a watch event (one line, one object) by
//! [`MAX_EVENT_BYTES`], a page of a list by [`MAX_PAGE_BYTES`] and a list
//! by [`MAX_PAGES`], an error body by [`MAX_ERROR_BYTES`]; every request
//! has a deadline.
//!
//! Why not kube-runtime's `watcher`: it decodes watch streams through
//! kube-client's `request_events`, whose `LinesCodec::new()` buffers a line
//! without limit (a line that never ends grows until the OOM killer ends
//! the daemon), and it resumes a watch that ended at once without any
//! pause. A layer on the client's HTTP stack could bound the bytes but not
//! the restarts. So kube-client carries the requests (kubeconfig, TLS,
//! client certificates, tokens), k8s-openapi and kube-core give the types,
//! and this module frames and bounds what comes back; the restart policy
//! lives in the caller ([`super::slices`]).

use std::time::Duration;

use http_body_util::BodyExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::{
    Client,
    client::Body,
    core::{
        ObjectList, Request, Resource, Status, WatchEvent,
        params::{ListParams, WatchParams},
    },
};
use tokio::time::{Instant, timeout, timeout_at};

/// Longest watch event: one line holding one object. Larger than any
/// object an apiserver stores (etcd refuses requests over 1.5 MiB).
pub const MAX_EVENT_BYTES: usize = 2 << 20;
/// Largest page of a list.
pub const MAX_PAGE_BYTES: usize = 8 << 20;
/// Pages of one list at most (each asks for [`PAGE_ITEMS`] slices).
pub const MAX_PAGES: usize = 64;
/// Slices asked for per page.
const PAGE_ITEMS: u32 = 100;
/// Longest error body read (it only goes into a log line, cut shorter).
const MAX_ERROR_BYTES: usize = 64 << 10;
/// Characters of a server's error message kept for the log.
const MAX_MESSAGE_CHARS: usize = 200;
/// Time a list page (request and whole answer) may take.
const PAGE_TIMEOUT: Duration = Duration::from_secs(30);
/// Time until a watch's answer starts.
const WATCH_START_TIMEOUT: Duration = Duration::from_secs(30);
/// `timeoutSeconds` of a watch: the server ends it then, and it resumes.
const WATCH_SECONDS: u32 = 290;
/// How long after `timeoutSeconds` a watch is given up as stalled.
const WATCH_GRACE: Duration = Duration::from_secs(30);

/// Why a request to the API failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{what}: {source}")]
    Client {
        what: &'static str,
        source: kube::Error,
    },
    #[error("{what}: the API answered {code}: {message}")]
    Status {
        what: &'static str,
        code: u16,
        message: String,
    },
    #[error("{what} is longer than {limit} bytes; refused")]
    TooLong { what: &'static str, limit: usize },
    #[error("{what} took longer than {after:?}")]
    Timeout { what: &'static str, after: Duration },
    #[error("{what} is not what the API sends: {source}")]
    Decode {
        what: &'static str,
        source: serde_json::Error,
    },
    #[error("the list has more than {MAX_PAGES} pages of {PAGE_ITEMS} slices")]
    TooManyPages,
    /// The watch's resource version is no longer kept (410 Gone): list again.
    #[error("the watch's resource version is gone (410)")]
    Expired,
}

/// The EndpointSlices of one Service in one namespace.
pub struct SliceApi {
    client: Client,
    request: Request,
    selector: String,
}

impl SliceApi {
    pub fn new(client: Client, namespace: &str, selector: String) -> Self {
        Self {
            client,
            request: Request::new(EndpointSlice::url_path(&(), Some(namespace))),
            selector,
        }
    }

    /// Lists the slices page by page, handing each to `each`; returns the
    /// list's resource version, to watch from.
    pub async fn list(&self, mut each: impl FnMut(EndpointSlice)) -> Result<String, ApiError> {
        let mut continue_token = None;
        for _ in 0..MAX_PAGES {
            let params = ListParams {
                label_selector: Some(self.selector.clone()),
                limit: Some(PAGE_ITEMS),
                continue_token: continue_token.take(),
                ..ListParams::default()
            };
            let what = "a list of EndpointSlices";
            let request = self
                .request
                .list(&params)
                .map_err(|source| request_error(what, source))?;
            let page = timeout(PAGE_TIMEOUT, self.fetch(request, what))
                .await
                .map_err(|_| ApiError::Timeout {
                    what,
                    after: PAGE_TIMEOUT,
                })??;
            let page: ObjectList<EndpointSlice> = serde_json::from_slice(&page)
                .map_err(|source| ApiError::Decode { what, source })?;
            page.items.into_iter().for_each(&mut each);
            match page.metadata.continue_.filter(|token| !token.is_empty()) {
                Some(token) => continue_token = Some(token),
                None => return Ok(page.metadata.resource_version.unwrap_or_default()),
            }
        }
        Err(ApiError::TooManyPages)
    }

    /// Starts a watch from `resource_version` (with bookmarks).
    pub async fn watch(&self, resource_version: &str) -> Result<Watch, ApiError> {
        let what = "a watch of EndpointSlices";
        let params = WatchParams {
            label_selector: Some(self.selector.clone()),
            timeout: Some(WATCH_SECONDS),
            bookmarks: true,
            ..WatchParams::default()
        };
        let request = self
            .request
            .watch(&params, resource_version)
            .map_err(|source| request_error(what, source))?;
        let body = timeout(WATCH_START_TIMEOUT, self.send(request, what))
            .await
            .map_err(|_| ApiError::Timeout {
                what,
                after: WATCH_START_TIMEOUT,
            })??;
        Ok(Watch {
            body,
            line: Vec::new(),
            scanned: 0,
            deadline: Instant::now() + Duration::from_secs(u64::from(WATCH_SECONDS)) + WATCH_GRACE,
        })
    }

    /// One request whose whole answer is read, at most [`MAX_PAGE_BYTES`].
    async fn fetch(
        &self,
        request: hyper::Request<Vec<u8>>,
        what: &'static str,
    ) -> Result<Vec<u8>, ApiError> {
        let mut body = self.send(request, what).await?;
        read_bounded(&mut body, MAX_PAGE_BYTES, what).await
    }

    /// Sends a request; an answer that is not a success becomes an error
    /// (410 Gone becomes [`ApiError::Expired`]).
    async fn send(
        &self,
        request: hyper::Request<Vec<u8>>,
        what: &'static str,
    ) -> Result<Body, ApiError> {
        let response = self
            .client
            .send(request.map(Body::from))
            .await
            .map_err(|source| ApiError::Client { what, source })?;
        let code = response.status();
        let mut body = response.into_body();
        if code.is_success() {
            return Ok(body);
        }
        if code == hyper::StatusCode::GONE {
            return Err(ApiError::Expired);
        }
        let text = read_bounded(&mut body, MAX_ERROR_BYTES, what)
            .await
            .unwrap_or_default();
        let message = serde_json::from_slice::<Status>(&text)
            .map(|status| status.message)
            .unwrap_or_else(|_| String::from_utf8_lossy(&text).into_owned());
        Err(ApiError::Status {
            what,
            code: code.as_u16(),
            message: printable(&message),
        })
    }
}

fn request_error(what: &'static str, source: kube::core::request::Error) -> ApiError {
    ApiError::Client {
        what,
        source: kube::Error::BuildRequest(source),
    }
}

/// Text from the API made fit for one log line: control characters
/// escaped, cut at [`MAX_MESSAGE_CHARS`].
pub fn printable(text: &str) -> String {
    let mut shown: String = text.chars().take(MAX_MESSAGE_CHARS).collect();
    if shown.len() < text.len() {
        shown.push('…');
    }
    shown.escape_debug().to_string()
}

/// Reads a body to its end, refusing one longer than `limit`.
async fn read_bounded(
    body: &mut Body,
    limit: usize,
    what: &'static str,
) -> Result<Vec<u8>, ApiError> {
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|source| ApiError::Client { what, source })?;
        if let Some(data) = frame.data_ref() {
            if bytes.len() + data.len() > limit {
                return Err(ApiError::TooLong { what, limit });
            }
            bytes.extend_from_slice(data);
        }
    }
    Ok(bytes)
}

/// An open watch: newline-delimited JSON events, each at most
/// [`MAX_EVENT_BYTES`].
pub struct Watch {
    body: Body,
    /// Bytes received and not yet handed out as an event.
    line: Vec<u8>,
    /// How much of `line` is known to hold no newline.
    scanned: usize,
    /// When the watch is given up as stalled.
    deadline: Instant,
}

impl Watch {
    /// The next event; None when the server ended the watch.
    pub async fn next(&mut self) -> Result<Option<WatchEvent<EndpointSlice>>, ApiError> {
        let what = "a watch event";
        // Each round either hands out a line or reads one more frame; the
        // deadline bounds the rounds in time, the line bound in memory.
        loop {
            if let Some(end) = self.line[self.scanned..]
                .iter()
                .position(|&byte| byte == b'\n')
            {
                let line: Vec<u8> = self.line.drain(..=self.scanned + end).collect();
                self.scanned = 0;
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return decode(&line).map(Some);
            }
            self.scanned = self.line.len();
            if self.line.len() > MAX_EVENT_BYTES {
                return Err(ApiError::TooLong {
                    what,
                    limit: MAX_EVENT_BYTES,
                });
            }
            let frame = timeout_at(self.deadline, self.body.frame())
                .await
                .map_err(|_| ApiError::Timeout {
                    what: "a watch",
                    after: Duration::from_secs(u64::from(WATCH_SECONDS)) + WATCH_GRACE,
                })?;
            match frame {
                // A last line without a newline is cut short: dropped.
                None => return Ok(None),
                Some(Err(source)) => return Err(ApiError::Client { what, source }),
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        self.line.extend_from_slice(data);
                    }
                }
            }
        }
    }
}

/// One watch line; an ERROR event becomes an error (410 Gone, or another).
fn decode(line: &[u8]) -> Result<WatchEvent<EndpointSlice>, ApiError> {
    let event: WatchEvent<EndpointSlice> =
        serde_json::from_slice(line).map_err(|source| ApiError::Decode {
            what: "a watch event",
            source,
        })?;
    match event {
        WatchEvent::Error(status) if status.code == 410 => Err(ApiError::Expired),
        WatchEvent::Error(status) => Err(ApiError::Status {
            what: "a watch",
            code: status.code,
            message: printable(&status.message),
        }),
        event => Ok(event),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_events_and_messages() {
        let gone = br#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","code":410,"message":"too old"}}"#;
        assert!(matches!(decode(gone), Err(ApiError::Expired)));
        let other =
            br#"{"type":"ERROR","object":{"kind":"Status","code":500,"message":"bad\nthing"}}"#;
        let error = decode(other).unwrap_err().to_string();
        assert_eq!(error, r"a watch: the API answered 500: bad\nthing");
        let bookmark = br#"{"type":"BOOKMARK","object":{"kind":"EndpointSlice","apiVersion":"discovery.k8s.io/v1","metadata":{"resourceVersion":"12"}}}"#;
        assert!(matches!(decode(bookmark), Ok(WatchEvent::Bookmark(_))));
        assert!(matches!(decode(b"{not json"), Err(ApiError::Decode { .. })));
        let long = "x".repeat(1000);
        assert_eq!(printable(&long).chars().count(), MAX_MESSAGE_CHARS + 1);
    }
}
