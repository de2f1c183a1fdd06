//! The store: slices, the global resource version, and the history of
//! events that watches resume from.

use std::{
    collections::{BTreeMap, VecDeque},
    hash::BuildHasher,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::SystemTime,
};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use socklb_tests::kube::SliceSpec;

use crate::pki::{PUBLIC, write_atomically};

/// Events kept for watches that resume; older versions get 410.
const HISTORY_LIMIT: usize = 1000;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredSlice {
    pub(crate) namespace: String,
    pub(crate) name: String,
    pub(crate) uid: String,
    pub(crate) creation_timestamp: String,
    pub(crate) generation: u64,
    pub(crate) resource_version: u64,
    pub(crate) spec: SliceSpec,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Added,
    Modified,
    Deleted,
}

impl EventKind {
    pub fn name(self) -> &'static str {
        match self {
            EventKind::Added => "ADDED",
            EventKind::Modified => "MODIFIED",
            EventKind::Deleted => "DELETED",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Event {
    pub(crate) kind: EventKind,
    pub(crate) resource_version: u64,
    /// The new state; for DELETED, the last state at the deletion's version.
    pub(crate) object: Arc<StoredSlice>,
    /// The state before a MODIFIED (a selector may match one and not the
    /// other).
    pub(crate) previous: Option<Arc<StoredSlice>>,
}

/// What state.json holds.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Persisted {
    resource_version: u64,
    slices: Vec<StoredSlice>,
}

pub struct Store {
    pub(crate) resource_version: u64,
    pub(crate) slices: BTreeMap<(String, String), Arc<StoredSlice>>,
    pub(crate) history: VecDeque<Event>,
    /// Every event newer than this version is in `history`.
    pub(crate) history_floor: u64,
    pub(crate) state_path: PathBuf,
}

/// A watch asked for a version older than the history keeps.
pub struct TooOld {
    pub(crate) oldest: u64,
}

impl Store {
    pub fn load(state_path: PathBuf) -> Result<Self> {
        let persisted: Persisted = match std::fs::read(&state_path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .with_context(|| format!("reading {}", state_path.display()))?,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Persisted {
                resource_version: 1,
                slices: Vec::new(),
            },
            Err(error) => return Err(error).context(format!("{}", state_path.display())),
        };
        let slices = persisted
            .slices
            .into_iter()
            .map(|slice| {
                (
                    (slice.namespace.clone(), slice.name.clone()),
                    Arc::new(slice),
                )
            })
            .collect();
        Ok(Self {
            resource_version: persisted.resource_version,
            slices,
            history: VecDeque::new(),
            history_floor: persisted.resource_version,
            state_path,
        })
    }

    pub fn persist(&self) -> Result<()> {
        let persisted = Persisted {
            resource_version: self.resource_version,
            slices: self
                .slices
                .values()
                .map(|slice| (**slice).clone())
                .collect(),
        };
        write_atomically(
            &self.state_path,
            &serde_json::to_vec_pretty(&persisted)?,
            PUBLIC,
        )
    }

    fn record(&mut self, event: Event) {
        self.history.push_back(event);
        while self.history.len() > HISTORY_LIMIT {
            if let Some(dropped) = self.history.pop_front() {
                self.history_floor = dropped.resource_version;
            }
        }
    }

    /// Creates or replaces a slice. An update that changes nothing makes
    /// no event and no new version, as in Kubernetes. The caller persists.
    pub fn put(&mut self, namespace: &str, name: &str, spec: SliceSpec) -> Option<Event> {
        let key = (namespace.to_string(), name.to_string());
        let previous = self.slices.get(&key).cloned();
        if previous.as_ref().is_some_and(|old| old.spec == spec) {
            return None;
        }
        self.resource_version += 1;
        let object = Arc::new(match &previous {
            Some(old) => StoredSlice {
                generation: old.generation + 1,
                resource_version: self.resource_version,
                spec,
                ..(**old).clone()
            },
            None => StoredSlice {
                namespace: namespace.to_string(),
                name: name.to_string(),
                uid: new_uid(),
                creation_timestamp: rfc3339(SystemTime::now()),
                generation: 1,
                resource_version: self.resource_version,
                spec,
            },
        });
        self.slices.insert(key, Arc::clone(&object));
        let event = Event {
            kind: if previous.is_some() {
                EventKind::Modified
            } else {
                EventKind::Added
            },
            resource_version: self.resource_version,
            object,
            previous,
        };
        self.record(event.clone());
        Some(event)
    }

    /// Deletes a slice, if there is one. The caller persists.
    pub fn delete(&mut self, namespace: &str, name: &str) -> Option<Event> {
        let old = self
            .slices
            .remove(&(namespace.to_string(), name.to_string()))?;
        self.resource_version += 1;
        let event = Event {
            kind: EventKind::Deleted,
            resource_version: self.resource_version,
            object: Arc::new(StoredSlice {
                resource_version: self.resource_version,
                ..(*old).clone()
            }),
            previous: Some(old),
        };
        self.record(event.clone());
        Some(event)
    }

    pub fn compact(&mut self) {
        self.history.clear();
        self.history_floor = self.resource_version;
    }

    /// The events after `since`, oldest first.
    pub fn events_after(&self, since: u64) -> Result<Vec<Event>, TooOld> {
        if since < self.history_floor {
            return Err(TooOld {
                oldest: self.history_floor,
            });
        }
        Ok(self
            .history
            .iter()
            .filter(|event| event.resource_version > since)
            .cloned()
            .collect())
    }
}

/// A random UUID (version 4 layout).
pub fn new_uid() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let high = std::hash::RandomState::new().hash_one(count);
    let low = std::hash::RandomState::new().hash_one(!count);
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        high >> 32,
        (high >> 16) & 0xffff,
        high & 0x0fff,
        0x8000 | ((low >> 48) & 0x3fff),
        low & 0xffff_ffff_ffff
    )
}

/// `2006-01-02T15:04:05Z`, the form of Kubernetes timestamps.
pub fn rfc3339(time: SystemTime) -> String {
    socklb::clock::rfc3339(time)
}
