//! The run directory of `gdn train`, and the rules that keep it consistent.
//!
//! - `config.toml`: the resolved run config, every key (what a resume reads);
//! - `metrics.jsonl`: one JSON object per line;
//! - `checkpoints/step-NNNNNNNN.safetensors`: see [`crate::train::checkpoint`];
//! - `curves.png`: optional plot.
//!
//! Rules:
//!
//! - Every file is written atomically (a temporary `<name>.tmp-*` beside it, synced, renamed;
//!   [`crate::io::write_atomic`]); `metrics.jsonl` grows by whole lines. A temporary file left by
//!   a killed write is removed when the run is next resumed ([`remove_stray_temps`]).
//! - A new run goes only into a new or an empty directory, so nothing a user keeps there is
//!   overwritten ([`NewRunDir::check`]); a start that fails before the first checkpoint removes
//!   what it created, and only that ([`NewRunDir`]).
//! - A resume reads a complete `config.toml` ([`read_config`]: an empty or partial one is
//!   refused, never completed from defaults) and the newest checkpoint that passes its checks,
//!   using an older one only when the newer ones are corrupt, and saying so ([`load_latest`]).

use std::cell::Cell;
use std::path::{Path, PathBuf};

use crate::error::{GdnError, Result};
use crate::io::{file_err, io_err};
use crate::train::checkpoint::{self, Checkpoint, Rejected};
use crate::train::RunConfig;

/// The run config file.
pub const CONFIG: &str = "config.toml";
/// The metrics file.
pub const METRICS: &str = "metrics.jsonl";
/// The checkpoint directory.
pub const CHECKPOINTS: &str = "checkpoints";
/// The plot.
pub const PLOT: &str = "curves.png";

/// Read the `config.toml` of the run in `dir`. It must hold every key of the run config (the
/// run wrote it whole): an empty file or one lacking keys is an error naming the file and the
/// missing keys, instead of a run silently continued with built-in defaults.
pub fn read_config(dir: &Path) -> Result<RunConfig> {
    let path = dir.join(CONFIG);
    if !path.exists() {
        return Err(file_err(
            dir,
            format!("no {CONFIG} there; is it a gdn train run directory?"),
        ));
    }
    let text = crate::io::read_text(&path)?;
    let restore = "a run's config.toml holds every key of its config (written whole when the run \
                   started; each checkpoint keeps a copy in its gdn.run_config metadata)";
    if text.trim().is_empty() {
        return Err(file_err(
            &path,
            format!("is empty, so the run's config is lost; {restore}"),
        ));
    }
    let cfg = RunConfig::from_toml_str(&text).map_err(|e| match e {
        GdnError::Config { field, msg } => GdnError::Config {
            field,
            msg: format!("{msg} (in {})", path.display()),
        },
        e => e,
    })?;
    let raw: toml::Table = toml::from_str(&text).map_err(|e| file_err(&path, e.message()))?;
    let present: Vec<String> = super::flat_table(raw).into_iter().map(|(k, _)| k).collect();
    let missing: Vec<String> = super::flat_config(&cfg)
        .into_iter()
        .map(|(k, _)| k)
        .filter(|k| !present.contains(k))
        .collect();
    if !missing.is_empty() {
        let shown: Vec<&str> = missing.iter().take(8).map(String::as_str).collect();
        let more = if missing.len() > shown.len() {
            format!(" and {} more", missing.len() - shown.len())
        } else {
            String::new()
        };
        return Err(file_err(
            &path,
            format!(
                "lacks {} key(s) of the run config: {}{more}; {restore}, so this one was \
                 truncated or edited",
                missing.len(),
                shown.join(", ")
            ),
        ));
    }
    Ok(cfg)
}

/// Is `name` the temporary file of an atomic write of one of the run's files in `dir` (`sub`
/// false) or in `checkpoints/` (`sub` true)?
fn is_stray_temp(name: &str, sub: bool) -> bool {
    let Some((target, _)) = name.split_once(".tmp-") else {
        return false;
    };
    if sub {
        checkpoint::step_of(target).is_some()
    } else {
        [CONFIG, METRICS, PLOT].contains(&target)
    }
}

/// Is the process that names a temporary file (`<name>.tmp-<pid>[-...]`) still running (and
/// not this one)? Then the file may be a write in progress (another `gdn` on the same run) and
/// is left alone. Known only where `/proc` exists; elsewhere every stray is removed.
fn writer_alive(name: &str) -> bool {
    let Some((_, rest)) = name.split_once(".tmp-") else {
        return false;
    };
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    match digits.parse::<u32>() {
        Ok(pid) if pid != std::process::id() => {
            Path::new("/proc/self").exists() && Path::new("/proc").join(&digits).exists()
        }
        _ => false,
    }
}

/// Remove the temporary files (`<run file>.tmp-*`) that a killed write left in the run directory
/// `dir` and its `checkpoints/`; only regular files named after one of the run's own files are
/// touched, and not while the process named in the file's name runs. Returns the paths removed.
pub fn remove_stray_temps(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for (d, sub) in [(dir.to_path_buf(), false), (dir.join(CHECKPOINTS), true)] {
        let rd = match std::fs::read_dir(&d) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err(&d, e)),
        };
        for e in rd {
            let e = e.map_err(|e| io_err(&d, e))?;
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if !is_stray_temp(name, sub) {
                continue;
            }
            let p = e.path();
            let is_file = std::fs::symlink_metadata(&p)
                .map(|m| m.file_type().is_file())
                .unwrap_or(false);
            if is_file && !writer_alive(name) {
                std::fs::remove_file(&p).map_err(|e| io_err(&p, e))?;
                removed.push(p);
            }
        }
    }
    Ok(removed)
}

/// The checkpoint a resume continues from.
#[derive(Debug)]
pub struct Latest {
    /// Its file.
    pub path: PathBuf,
    /// Its content, checked for integrity ([`Checkpoint::load`]).
    pub checkpoint: Checkpoint,
    /// Newer checkpoints that were rejected as corrupt, newest first, with the reason.
    pub rejected: Vec<(PathBuf, GdnError)>,
}

/// The newest checkpoint of `ckdir` that loads ([`Checkpoint::load`]). A corrupt newer one is
/// passed over (and listed in [`Latest::rejected`]); one that cannot be read or is of another
/// format version is an error, as is a directory with no checkpoint or none that loads.
pub fn load_latest(ckdir: &Path) -> Result<Latest> {
    let all = checkpoint::all(ckdir)?;
    if all.is_empty() {
        return Err(file_err(
            ckdir,
            "no checkpoint (step-NNNNNNNN.safetensors) there",
        ));
    }
    let mut rejected = Vec::new();
    for (_, path) in all {
        match Checkpoint::load_checked(&path) {
            Ok(checkpoint) => {
                return Ok(Latest {
                    path,
                    checkpoint,
                    rejected,
                })
            }
            Err(Rejected::Corrupt(e)) => rejected.push((path, e)),
            Err(Rejected::Unusable(e)) => return Err(e),
        }
    }
    let why: Vec<String> = rejected.iter().map(|(_, e)| e.to_string()).collect();
    Err(file_err(
        ckdir,
        format!("no usable checkpoint: {}", why.join("; ")),
    ))
}

/// A new run directory being set up. It remembers the directories and files this process
/// created, and removes exactly those (directories only when empty) when it is dropped before
/// [`keep`](Self::keep) (the run's first checkpoint) was called: a start that fails leaves
/// nothing behind, and never touches what existed before.
#[derive(Debug)]
pub struct NewRunDir {
    dir: PathBuf,
    dirs: Vec<PathBuf>,
    files: Vec<PathBuf>,
    kept: Cell<bool>,
}

impl NewRunDir {
    /// Can a new run go into `dir`? Yes when it does not exist or is an empty directory; an
    /// error names what is in the way (a run, other files, a non-directory).
    pub fn check(dir: &Path) -> Result<()> {
        let md = match std::fs::metadata(dir) {
            Ok(md) => md,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err(dir, e)),
        };
        if !md.is_dir() {
            return Err(file_err(
                dir,
                "exists and is not a directory; choose another run directory",
            ));
        }
        if dir.join(CONFIG).exists() || dir.join(CHECKPOINTS).exists() {
            return Err(file_err(
                dir,
                format!(
                    "already holds a run; continue it with --resume {} or choose another --out",
                    dir.display()
                ),
            ));
        }
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .map_err(|e| io_err(dir, e))?
            .map(|e| {
                e.map(|e| e.file_name().to_string_lossy().into_owned())
                    .map_err(|e| io_err(dir, e))
            })
            .collect::<Result<_>>()?;
        if !names.is_empty() {
            names.sort();
            let more = if names.len() > 3 { ", ..." } else { "" };
            names.truncate(3);
            return Err(file_err(
                dir,
                format!(
                    "exists and is not empty (it holds {}{more}); a new run goes into a new or \
                     empty directory so that nothing in it is overwritten: choose another --out",
                    names.join(", ")
                ),
            ));
        }
        Ok(())
    }

    /// [`check`](Self::check) `dir`, then create it and any missing parent.
    pub fn create(dir: &Path) -> Result<Self> {
        Self::check(dir)?;
        let mut missing = Vec::new();
        for a in dir.ancestors() {
            if a.as_os_str().is_empty() || std::fs::symlink_metadata(a).is_ok() {
                break;
            }
            missing.push(a.to_path_buf());
        }
        let mut me = NewRunDir {
            dir: dir.to_path_buf(),
            dirs: Vec::new(),
            files: Vec::new(),
            kept: Cell::new(false),
        };
        for d in missing.into_iter().rev() {
            me.create_dir(&d)?;
        }
        Ok(me)
    }

    fn create_dir(&mut self, d: &Path) -> Result<()> {
        match std::fs::create_dir(d) {
            Ok(()) => {
                self.dirs.push(d.to_path_buf());
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && d.is_dir() => Ok(()),
            Err(e) => Err(io_err(d, e)),
        }
    }

    /// The run directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Create the subdirectory `name` of the run directory.
    pub fn create_subdir(&mut self, name: &str) -> Result<PathBuf> {
        let d = self.dir.join(name);
        self.create_dir(&d)?;
        Ok(d)
    }

    /// Write the file `name` of the run directory atomically.
    pub fn write_file(&mut self, name: &str, bytes: &[u8]) -> Result<PathBuf> {
        let p = self.dir.join(name);
        crate::io::write_atomic(&p, bytes)?;
        self.files.push(p.clone());
        Ok(p)
    }

    /// The run has its first checkpoint: keep everything from now on.
    pub fn keep(&self) {
        self.kept.set(true);
    }

    /// Whether [`keep`](Self::keep) was called.
    pub fn is_kept(&self) -> bool {
        self.kept.get()
    }

    /// Remove what this process created (unless kept): its files, then its directories when
    /// empty. Returns one line per thing removed or left in place. Called by `drop` too.
    pub fn remove_created(&mut self) -> Vec<String> {
        let mut notes = Vec::new();
        if self.kept.get() {
            return notes;
        }
        for f in self.files.drain(..).rev() {
            match std::fs::remove_file(&f) {
                Ok(()) => notes.push(format!("removed {}", f.display())),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => notes.push(format!("could not remove {}: {e}", f.display())),
            }
        }
        for d in self.dirs.drain(..).rev() {
            match std::fs::remove_dir(&d) {
                Ok(()) => notes.push(format!("removed {}", d.display())),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(_) => notes.push(format!(
                    "left {} in place: it holds files this run did not write",
                    d.display()
                )),
            }
        }
        notes
    }
}

impl Drop for NewRunDir {
    fn drop(&mut self) {
        self.remove_created();
    }
}
