//! The last known backend set of each service, kept in the state directory
//! (`--state-dir`, default /var/lib/socklb) as `backends.json`, so that a
//! start whose sources are all unreachable still knows the servers.
//!
//! Written atomically: a temporary file in the same directory, fsync,
//! rename over the old file, fsync of the directory; mode 0600, directory
//! 0700. A file that cannot be parsed, or that is not socklb's (another
//! format or version), is reported and ignored, never trusted.

use std::{
    collections::BTreeMap,
    fs,
    io::Write,
    os::unix::fs::{DirBuilderExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use super::{BackendSet, Source};

/// The default state directory.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/socklb";
const FILE_NAME: &str = "backends.json";
const FORMAT: &str = "socklb-backends";
const VERSION: u32 = 1;
/// A state file larger than this is not ours.
const MAX_BYTES: u64 = 4 << 20;

/// What the file holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct StateFile {
    format: String,
    version: u32,
    services: BTreeMap<String, Persisted>,
}

/// One service's last known set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Persisted {
    /// The source the set came from.
    pub source: Source,
    pub backends: BackendSet,
}

/// Why the file was not used.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a socklb state file ({why}); ignored")]
    Foreign { path: String, why: String },
}

fn io_error(path: &Path, source: std::io::Error) -> PersistError {
    PersistError::Io {
        path: path.display().to_string(),
        source,
    }
}

#[derive(Debug, Clone)]
pub struct StateDir {
    dir: PathBuf,
}

impl StateDir {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn file(&self) -> PathBuf {
        self.dir.join(FILE_NAME)
    }

    /// The persisted sets; empty when there is no file yet.
    pub fn load(&self) -> Result<BTreeMap<String, Persisted>, PersistError> {
        use std::io::Read;
        let path = self.file();
        let file = match fs::File::open(&path) {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                return Ok(BTreeMap::new());
            }
            Err(error) => return Err(io_error(&path, error)),
        };
        let foreign = |why: String| PersistError::Foreign {
            path: path.display().to_string(),
            why,
        };
        let metadata = file.metadata().map_err(|error| io_error(&path, error))?;
        if !metadata.is_file() {
            return Err(foreign("not a regular file".into()));
        }
        let mut text = String::new();
        file.take(MAX_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|error| foreign(error.to_string()))?;
        if text.len() as u64 > MAX_BYTES {
            return Err(foreign("larger than 4 MiB".into()));
        }
        let state: StateFile =
            serde_json::from_str(&text).map_err(|error| foreign(error.to_string()))?;
        if state.format != FORMAT || state.version != VERSION {
            return Err(foreign(format!(
                "format {:?} version {}, expected {FORMAT:?} version {VERSION}",
                state.format, state.version
            )));
        }
        Ok(state.services)
    }

    /// Replaces the file with these sets, atomically.
    pub fn save(&self, services: &BTreeMap<String, Persisted>) -> Result<(), PersistError> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(|error| io_error(&self.dir, error))?;
        let state = StateFile {
            format: FORMAT.into(),
            version: VERSION,
            services: services.clone(),
        };
        let mut text = serde_json::to_string_pretty(&state)
            .map_err(|error| io_error(&self.file(), std::io::Error::other(error.to_string())))?;
        text.push('\n');
        let temporary = self
            .dir
            .join(format!(".{FILE_NAME}.{}.tmp", std::process::id()));
        let written = (|| {
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&temporary)?;
            file.write_all(text.as_bytes())?;
            file.sync_all()?;
            fs::rename(&temporary, self.file())?;
            fs::File::open(&self.dir)?.sync_all()
        })();
        if let Err(error) = written {
            let _ = fs::remove_file(&temporary);
            return Err(io_error(&self.file(), error));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::discovery::Found;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("socklb-persist-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn round_trip_with_mode_0600() {
        let dir = temp_dir("round");
        let state = StateDir::new(&dir);
        assert!(state.load().unwrap().is_empty());
        let mut services = BTreeMap::new();
        services.insert(
            "apiserver".to_string(),
            Persisted {
                source: Source::EndpointSlices,
                backends: [Found {
                    addr: "10.0.0.1:6443".parse().unwrap(),
                    standby: false,
                }]
                .into(),
            },
        );
        state.save(&services).unwrap();
        assert_eq!(state.load().unwrap(), services);
        let mode = fs::metadata(state.file()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let leftovers = fs::read_dir(&dir).unwrap().count();
        assert_eq!(leftovers, 1, "no temporary file stays");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn corrupt_and_foreign_files_are_refused() {
        let dir = temp_dir("foreign");
        fs::create_dir_all(&dir).unwrap();
        let state = StateDir::new(&dir);
        for text in [
            "{ not json",
            r#"{"format":"other","version":1,"services":{}}"#,
            r#"{"format":"socklb-backends","version":9,"services":{}}"#,
            r#"{"format":"socklb-backends","version":1,"services":{"a":{"source":"static","backends":[{"addr":"nope"}]}}}"#,
        ] {
            fs::write(state.file(), text).unwrap();
            let error = state.load().unwrap_err().to_string();
            assert!(error.contains("not a socklb state file"), "{error}");
        }
        fs::remove_dir_all(&dir).unwrap();
    }
}
