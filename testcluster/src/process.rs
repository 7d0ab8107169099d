//! Child processes that cannot outlive the test process.
//!
//! Each control-plane binary runs under a small `sh` supervisor whose standard input is a pipe
//! held only by the test process. When the test process ends — normally, by panic, or killed —
//! the pipe closes, the supervisor's `read` returns, and it stops the binary (SIGTERM, then
//! SIGKILL after five seconds). Dropping a [`Supervised`] closes the pipe the same way and waits.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use crate::Error;

/// The supervisor: starts `"$@"` with output to `$FERRITE_LOG`, prints its pid, waits for EOF
/// on stdin (or a signal to itself), then stops it and removes `$FERRITE_CLEANUP` if set.
/// The no-op trap (not an ignore, which the binary would inherit) keeps the supervisor alive
/// through a signal sent to the whole process group, so the SIGKILL fallback still happens.
const SUPERVISOR: &str = r#"
trap ':' TERM INT HUP
"$@" </dev/null >>"$FERRITE_LOG" 2>&1 &
pid=$!
echo "$pid"
read -r _ || true
kill -TERM "$pid" 2>/dev/null
i=0
while kill -0 "$pid" 2>/dev/null; do
  i=$((i + 1))
  if [ "$i" -gt 50 ]; then kill -KILL "$pid" 2>/dev/null; fi
  sleep 0.1
done
if [ -n "$FERRITE_CLEANUP" ]; then rm -rf "$FERRITE_CLEANUP"; fi
"#;

/// One supervised control-plane process.
#[derive(Debug)]
pub struct Supervised {
    name: String,
    pid: u32,
    log: PathBuf,
    supervisor: Child,
    stdin: Option<ChildStdin>,
}

impl Supervised {
    /// Starts `program args...` under a supervisor, logging to `log`. When `cleanup` is given,
    /// the supervisor deletes that folder after the binary has stopped — even when the test
    /// process died without dropping anything.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        log: &Path,
        cleanup: Option<&Path>,
    ) -> Result<Self, Error> {
        let mut supervisor = Command::new("sh")
            .arg("-c")
            .arg(SUPERVISOR)
            .arg(name)
            .arg(program)
            .args(args)
            .env("FERRITE_LOG", log)
            .env("FERRITE_CLEANUP", cleanup.unwrap_or(Path::new("")))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| Error::Spawn {
                name: name.to_string(),
                source: e,
            })?;
        let stdin = supervisor.stdin.take();
        let mut line = String::new();
        if let Some(out) = supervisor.stdout.take() {
            BufReader::new(out)
                .read_line(&mut line)
                .map_err(|e| Error::Spawn {
                    name: name.to_string(),
                    source: e,
                })?;
        }
        let pid = line.trim().parse::<u32>().map_err(|_| Error::Spawn {
            name: name.to_string(),
            source: std::io::Error::other(format!("supervisor printed {line:?}, not a pid")),
        })?;
        Ok(Self {
            name: name.to_string(),
            pid,
            log: log.to_path_buf(),
            supervisor,
            stdin,
        })
    }

    /// The process name given at spawn (`etcd`, `kube-apiserver`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The pid of the binary itself (not of its supervisor).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the binary is still running.
    pub fn is_running(&self) -> bool {
        pid_alive(self.pid)
    }

    /// The last `max` bytes of the binary's log, for error messages.
    pub fn log_tail(&self, max: usize) -> String {
        log_tail(&self.log, max)
    }

    /// Stops the binary and waits for its supervisor to exit.
    pub fn stop(&mut self) {
        // Closing the pipe is the stop signal.
        self.stdin.take();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.supervisor.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() > deadline => {
                    let _ = self.supervisor.kill();
                    let _ = self.supervisor.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether a process with this pid exists and is not a zombie.
pub fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// Pids of live processes whose command line mentions `needle` (a cluster's data folder).
pub fn processes_mentioning(needle: &str) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(mut f) = std::fs::File::open(entry.path().join("cmdline")) else {
            continue;
        };
        let mut raw = Vec::new();
        if f.read_to_end(&mut raw).is_err() {
            continue;
        }
        let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
        if cmdline.contains(needle) && pid_alive(pid) && pid != std::process::id() {
            found.push((pid, cmdline.trim().to_string()));
        }
    }
    found
}

/// The last `max` bytes of a log file (lossy UTF-8), or a note that it could not be read.
pub fn log_tail(path: &Path, max: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let start = bytes.len().saturating_sub(max);
            String::from_utf8_lossy(&bytes[start..]).into_owned()
        }
        Err(e) => format!("(no log at {}: {e})", path.display()),
    }
}
