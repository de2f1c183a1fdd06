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
use crate::trust::{self, Owner};

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

    /// Refuses a directory (or a file in it) that another user owns or
    /// that others can write: whoever can write there could plant the set
    /// a restarted daemon redirects to.
    fn check_owner(path: &Path, metadata: &fs::Metadata) -> Result<(), PersistError> {
        trust::check(metadata, Owner::Me).map_err(|why| PersistError::Foreign {
            path: path.display().to_string(),
            why: format!("it {why}; it must be socklb's own and writable by it alone"),
        })
    }

    /// The persisted sets; empty when there is no file yet.
    pub fn load(&self) -> Result<BTreeMap<String, Persisted>, PersistError> {
        use std::io::Read;
        match fs::symlink_metadata(&self.dir) {
            Ok(metadata) => Self::check_owner(&self.dir, &metadata)?,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                return Ok(BTreeMap::new());
            }
            Err(error) => return Err(io_error(&self.dir, error)),
        }
        let path = self.file();
        // Not through a symlink, and never blocking on a FIFO.
        let opened = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path);
        let file = match opened {
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
        Self::check_owner(&path, &metadata)?;
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
        let metadata =
            fs::symlink_metadata(&self.dir).map_err(|error| io_error(&self.dir, error))?;
        Self::check_owner(&self.dir, &metadata)?;
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
            // A file left by a crash of a daemon with the same pid goes;
            // then a new one, never one that exists or a symlink.
            let _ = fs::remove_file(&temporary);
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW)
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

        // A directory others can write is not trusted, for reading or
        // writing; nor a symlink in place of the file.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
        let refused = state.load().unwrap_err().to_string();
        assert!(refused.contains("writable by it alone"), "{refused}");
        assert!(state.save(&services).is_err());
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
        fs::remove_file(state.file()).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", state.file()).unwrap();
        assert!(state.load().is_err(), "a symlink is not followed");
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
