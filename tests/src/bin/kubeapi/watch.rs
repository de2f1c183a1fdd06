//! Watches: replayed from the history, then live, with bookmarks, a 410
//! for a version the history no longer has, and an end on timeoutSeconds
//! or the admin API's close-watches.

use std::{
    collections::HashMap,
    convert::Infallible,
    pin::Pin,
    sync::{Arc, atomic::Ordering},
    task::{Context as TaskContext, Poll},
    time::Duration,
};

use http_body_util::BodyExt;
use hyper::{
    Response, StatusCode,
    body::{Bytes, Frame},
    header,
};
use serde_json::{Value, json};
use tokio::{
    sync::{mpsc, watch},
    time::{Instant, sleep_until},
};

use crate::{
    Server,
    api::{Body, GROUP_VERSION, KIND, bad_request, slice_json, status_json},
    bump,
    selector::{Selector, parse_bool},
    store::TooOld,
};

/// A watch without `timeoutSeconds` ends after this (a real apiserver
/// picks 30 to 60 minutes).
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);
const MAX_WATCH_TIMEOUT: Duration = Duration::from_secs(3600);
/// Lines a watch buffers for a slow client before it waits.
const WATCH_BUFFER: usize = 64;

/// A watch's body: the lines its task sends, chunk by chunk, until the
/// task ends.
pub struct ChannelBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(context)
            .map(|line| line.map(|bytes| Ok(Frame::data(bytes))))
    }
}

pub fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut bytes = serde_json::to_vec(&json!({"type": kind, "object": object})).expect("JSON");
    bytes.push(b'\n');
    Bytes::from(bytes)
}

pub fn bookmark_line(resource_version: u64, initial_events_end: bool) -> Bytes {
    let mut metadata = json!({"resourceVersion": resource_version.to_string()});
    if initial_events_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    event_line(
        "BOOKMARK",
        &json!({"apiVersion": GROUP_VERSION, "kind": KIND, "metadata": metadata}),
    )
}

pub fn start_watch(
    server: &Arc<Server>,
    selector: Selector,
    query: &HashMap<String, String>,
) -> (Response<Body>, String) {
    let flags = (
        parse_bool("allowWatchBookmarks", query.get("allowWatchBookmarks")),
        parse_bool("sendInitialEvents", query.get("sendInitialEvents")),
    );
    let (bookmarks, send_initial_events) = match flags {
        (Ok(bookmarks), Ok(initial)) => (bookmarks, initial),
        (Err(message), _) | (_, Err(message)) => return (bad_request(&message), String::new()),
    };
    let timeout = match query.get("timeoutSeconds").map(|text| text.parse::<u64>()) {
        None | Some(Ok(0)) => DEFAULT_WATCH_TIMEOUT,
        Some(Ok(seconds)) => Duration::from_secs(seconds).min(MAX_WATCH_TIMEOUT),
        Some(Err(_)) => return (bad_request("invalid timeoutSeconds"), String::new()),
    };
    let requested = query
        .get("resourceVersion")
        .map_or("", String::as_str)
        .to_string();
    // An empty version or "0" means "the current state, then changes",
    // which the apiserver serves as synthetic ADDED events.
    let from_now = requested.is_empty() || requested == "0";
    let since = if from_now {
        None
    } else {
        match requested.parse::<u64>() {
            Ok(version) => Some(version),
            Err(_) => {
                return (
                    bad_request(&format!("invalid resource version {requested:?}")),
                    String::new(),
                );
            }
        }
    };
    let (initial, processed) = {
        let store = server.store();
        if from_now || send_initial_events {
            let added = store
                .slices
                .values()
                .filter(|slice| selector.matches(slice))
                .map(|slice| event_line("ADDED", &slice_json(slice, true)))
                .collect();
            (added, store.resource_version)
        } else {
            (Vec::new(), since.unwrap_or(store.resource_version))
        }
    };
    let id = server.stats.watches.fetch_add(1, Ordering::Relaxed) + 1;
    let (sender, receiver) = mpsc::channel(WATCH_BUFFER);
    let mut stream = WatchStream {
        id,
        server: Arc::clone(server),
        selector,
        processed,
        sender,
        deadline: Instant::now() + timeout,
        bookmarks,
        close: server.close_watches.subscribe(),
        version: server.version_changed.subscribe(),
        events: 0,
        _open: OpenWatch::new(Arc::clone(server)),
    };
    let initial_events_end = send_initial_events && bookmarks;
    tokio::spawn(async move {
        let ended = stream.run(initial, initial_events_end).await;
        eprintln!(
            "kubeapi: watch {} ended ({ended}) after {} events, at version {}",
            stream.id, stream.events, stream.processed
        );
    });
    let response = Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(ChannelBody(receiver).boxed())
        .expect("a response");
    (
        response,
        format!(" (watch {id} from version {requested:?})"),
    )
}

/// Counts a watch as open while it lives.
pub struct OpenWatch(Arc<Server>);

impl OpenWatch {
    fn new(server: Arc<Server>) -> Self {
        bump(&server.stats.watches_open);
        Self(server)
    }
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.0.stats.watches_open.fetch_sub(1, Ordering::Relaxed);
    }
}

pub struct WatchStream {
    id: u64,
    server: Arc<Server>,
    selector: Selector,
    /// Every event up to this version has been sent or filtered out.
    processed: u64,
    sender: mpsc::Sender<Bytes>,
    deadline: Instant,
    bookmarks: bool,
    close: watch::Receiver<u64>,
    version: watch::Receiver<u64>,
    events: u64,
    /// Held for its Drop.
    _open: OpenWatch,
}

/// Why a watch stream ended.
pub type Ended = &'static str;

pub enum Wake {
    Changed,
    Bookmark,
    Ended(Ended),
}

impl WatchStream {
    async fn run(&mut self, initial: Vec<Bytes>, initial_events_end: bool) -> Ended {
        let Err(why) = self.stream(initial, initial_events_end).await;
        why
    }

    async fn stream(
        &mut self,
        initial: Vec<Bytes>,
        initial_events_end: bool,
    ) -> Result<Infallible, Ended> {
        for line in initial {
            self.emit(line).await?;
            self.events += 1;
            bump(&self.server.stats.events_sent);
        }
        if initial_events_end {
            self.emit(bookmark_line(self.processed, true)).await?;
            bump(&self.server.stats.bookmarks_sent);
        }
        let interval = self.server.bookmark_interval;
        let mut ticks = tokio::time::interval_at(Instant::now() + interval, interval);
        // After a slow client, one bookmark, not a burst of them.
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The deadline bounds this loop in time; each round waits for a
        // change, a tick, the close signal or the deadline.
        loop {
            self.version.borrow_and_update();
            self.catch_up().await?;
            let wake = tokio::select! {
                changed = self.version.changed() => match changed {
                    Ok(()) => Wake::Changed,
                    Err(_) => Wake::Ended("the server is stopping"),
                },
                _ = ticks.tick(), if self.bookmarks => Wake::Bookmark,
                _ = self.close.changed() => Wake::Ended("closed by the admin API"),
                () = sleep_until(self.deadline) => Wake::Ended("timeoutSeconds"),
                () = self.sender.closed() => Wake::Ended("the client went away"),
            };
            match wake {
                Wake::Changed => {}
                Wake::Bookmark => {
                    self.emit(bookmark_line(self.processed, false)).await?;
                    bump(&self.server.stats.bookmarks_sent);
                }
                Wake::Ended(why) => return Err(why),
            }
        }
    }

    /// Sends the events after `processed` that the selector sees, or one
    /// 410 ERROR if the history no longer has them.
    async fn catch_up(&mut self) -> Result<(), Ended> {
        let events = self.server.store().events_after(self.processed);
        let events = match events {
            Ok(events) => events,
            Err(TooOld { oldest }) => {
                let message = format!("too old resource version: {} ({oldest})", self.processed);
                let status = status_json(StatusCode::GONE, "Expired", &message);
                self.emit(event_line("ERROR", &status)).await?;
                bump(&self.server.stats.gone_sent);
                return Err("410 Expired");
            }
        };
        for event in events {
            if let Some(kind) = self.selector.view(&event) {
                self.emit(event_line(kind.name(), &slice_json(&event.object, true)))
                    .await?;
                self.events += 1;
                bump(&self.server.stats.events_sent);
            }
            self.processed = event.resource_version;
        }
        Ok(())
    }

    /// Queues one line, unless the watch ends first.
    async fn emit(&mut self, line: Bytes) -> Result<(), Ended> {
        tokio::select! {
            sent = self.sender.send(line) => sent.map_err(|_| "the client went away"),
            _ = self.close.changed() => Err("closed by the admin API"),
            () = sleep_until(self.deadline) => Err("timeoutSeconds"),
        }
    }
}
