//! Misbehaviour on demand (the admin API's `PUT /faults`): watches that
//! fail or end at once, and watch lines or lists that never end, for the
//! tests of a client's bounds and backoff.

use std::{
    convert::Infallible,
    pin::Pin,
    sync::{Arc, atomic::Ordering},
    task::{Context as TaskContext, Poll},
};

use http_body_util::{BodyExt, Empty};
use hyper::{
    Response, StatusCode,
    body::{Bytes, Frame},
    header,
};
use socklb_tests::kube::{ListFault, WatchFault};

use crate::{
    Server,
    api::{Body, GROUP_VERSION, error_response},
    bump,
};

/// Bytes of one frame of an endless body.
const CHUNK_BYTES: usize = 64 * 1024;
/// An endless body ends after this many bytes all the same, so that a
/// client with no bound at all cannot keep the server busy for ever.
const MAX_ENDLESS_BYTES: u64 = 8 << 30;

/// The answer to a watch request under the current faults, if any.
pub fn watch_fault(server: &Arc<Server>) -> Option<(Response<Body>, String)> {
    let fault = server.faults().watch;
    let answer = match fault {
        WatchFault::None => return None,
        WatchFault::Error => {
            bump(&server.stats.failed_watches);
            error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                "watch refused by the test fault",
            )
        }
        WatchFault::Close => {
            bump(&server.stats.failed_watches);
            Response::builder()
                .header(header::CONTENT_TYPE, "application/json")
                .body(Empty::new().boxed())
                .expect("a response")
        }
        WatchFault::EndlessLine => {
            let start = br#"{"type":"ADDED","object":{"kind":"EndpointSlice","metadata":{"name":""#;
            endless(server, start)
        }
    };
    Some((answer, format!(" (watch fault {fault:?})")))
}

/// The answer to a list request under the current faults, if any.
pub fn list_fault(server: &Arc<Server>) -> Option<(Response<Body>, String)> {
    match server.faults().list {
        ListFault::None => None,
        ListFault::Endless => {
            let start = format!(
                r#"{{"apiVersion":"{GROUP_VERSION}","kind":"EndpointSliceList","metadata":{{"resourceVersion":"1"}},"items":[{{"metadata":{{"name":""#
            );
            Some((endless(server, start.as_bytes()), " (endless list)".into()))
        }
    }
}

fn endless(server: &Arc<Server>, start: &[u8]) -> Response<Body> {
    bump(&server.stats.endless_answers);
    let body = EndlessBody {
        server: Arc::clone(server),
        start: Some(Bytes::copy_from_slice(start)),
        chunk: Bytes::from(vec![b'a'; CHUNK_BYTES]),
        sent: 0,
    };
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.boxed())
        .expect("a response")
}

/// `start`, then `a` without end (up to [`MAX_ENDLESS_BYTES`]): a JSON
/// string that never closes, in one line.
struct EndlessBody {
    server: Arc<Server>,
    start: Option<Bytes>,
    chunk: Bytes,
    sent: u64,
}

impl hyper::body::Body for EndlessBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _context: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.sent >= MAX_ENDLESS_BYTES {
            return Poll::Ready(None);
        }
        let data = self.start.take().unwrap_or_else(|| self.chunk.clone());
        self.sent += data.len() as u64;
        self.server
            .stats
            .endless_bytes_sent
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Poll::Ready(Some(Ok(Frame::data(data))))
    }
}
