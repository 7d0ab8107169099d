//! Memory shared between the processes of one host: a file under `/dev/shm` mapped into
//! each of them, through which tensor-parallel ranks exchange activations without a socket
//! or a system call per message. The region is bytes plus 64-bit atomic words; the protocol
//! that orders writes and reads (barriers on those words) lives with its user.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

/// A shared, writable mapping of a file, unmapped on drop (and the file removed by its
/// creator, if it still exists).
#[derive(Debug)]
pub struct SharedRegion {
    ptr: NonNull<u8>,
    len: usize,
    path: PathBuf,
    owner: bool,
}

// SAFETY: the mapping lives until `Drop`; every access goes through the bounds-checked
// copies and atomics below, which are as valid from any thread as from the one that mapped
// it (other processes write the same bytes; see `read`).
unsafe impl Send for SharedRegion {}
// SAFETY: as above: no method hands out a reference to bytes other than the atomics.
unsafe impl Sync for SharedRegion {}

/// Where shared regions are created: `/dev/shm` (memory) where it exists, else the
/// temporary directory.
pub fn shared_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    match shm.is_dir() {
        true => shm.to_path_buf(),
        false => std::env::temp_dir(),
    }
}

/// Bytes free to an unprivileged writer on the filesystem holding `dir`, if it can be told.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statvfs` fills the zeroed struct it is given from a NUL-terminated path that
    // lives across the call; the result is checked before the struct is read.
    let stat = unsafe {
        let mut stat: libc::statvfs = std::mem::zeroed();
        (libc::statvfs(c.as_ptr(), &mut stat) == 0).then_some(stat)
    }?;
    Some(stat.f_bavail as u64 * stat.f_frsize as u64)
}

/// A name beside `path`, unique to this process and call, under which a region is sized
/// before it appears at `path`.
fn staging_name(path: &Path) -> PathBuf {
    use std::sync::atomic::Ordering;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut name = path.as_os_str().to_os_string();
    name.push(format!(".{}.{n}.staging", std::process::id()));
    PathBuf::from(name)
}

impl SharedRegion {
    /// Creates the file `path` (which must not exist; readable and writable by this user
    /// only) of `len` bytes, zeroed, and maps it.
    pub fn create(path: &Path, len: usize) -> io::Result<Self> {
        // A mapping beyond what the filesystem can hold faults when first touched (SIGBUS),
        // so a region that cannot fit is refused now, with the sizes.
        let dir = path.parent().unwrap_or(Path::new("/"));
        if let Some(free) = free_bytes(dir) {
            if free < len as u64 {
                return Err(io::Error::new(
                    io::ErrorKind::StorageFull,
                    format!(
                        "needs {} MiB but {} has {} MiB free; give it more (in Kubernetes, an \
                         emptyDir with medium: Memory mounted at /dev/shm)",
                        len >> 20,
                        dir.display(),
                        free >> 20
                    ),
                ));
            }
        }
        // The file is sized under a name of its own and only then linked at `path`, so a
        // process that opens `path` never finds it shorter than `len` (an opener racing
        // `set_len` would otherwise map an empty or partial file).
        let staging = staging_name(path);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&staging)?;
        let placed = file
            .set_len(len as u64)
            .and_then(|()| std::fs::hard_link(&staging, path));
        let _ = std::fs::remove_file(&staging);
        placed?;
        Self::map(&file, path, len, true).inspect_err(|_| {
            let _ = std::fs::remove_file(path);
        })
    }

    /// Maps the existing file `path`, all of it.
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = file.metadata()?.len() as usize;
        Self::map(&file, path, len, false)
    }

    fn map(file: &File, path: &Path, len: usize, owner: bool) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a shared region needs at least one byte",
            ));
        }
        // SAFETY: a fresh shared mapping of `len` bytes of an open file descriptor; the
        // result is checked, and the mapping outlives the descriptor (closed on return).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(io::Error::last_os_error)?;
        Ok(SharedRegion {
            ptr,
            len,
            path: path.to_path_buf(),
            owner,
        })
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: mapping refuses zero bytes).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file mapped.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the file's name (the mappings stay valid), so nothing is left behind however
    /// the processes later end. Once every member has mapped it, the creator calls this.
    pub fn unlink(&self) {
        let _ = std::fs::remove_file(&self.path);
    }

    /// The 64-bit word at byte `8 * index`, as an atomic shared with every process mapping
    /// the region; panics beyond the region.
    pub fn word(&self, index: usize) -> &AtomicU64 {
        let at = index * 8;
        assert!(
            at + 8 <= self.len,
            "word {index} beyond a region of {} bytes",
            self.len
        );
        // SAFETY: in bounds (checked), 8-byte aligned (the mapping is page-aligned), and
        // only ever accessed atomically by the protocol using it; the reference lives no
        // longer than `self`, hence the mapping.
        unsafe { AtomicU64::from_ptr(self.ptr.as_ptr().add(at).cast::<u64>()) }
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "bytes {offset}..+{len} beyond a region of {} bytes",
            self.len
        );
    }

    /// Copies `src` into the region at byte `offset`; panics beyond the region.
    pub fn write(&self, offset: usize, src: &[u8]) {
        self.check(offset, src.len());
        // SAFETY: in bounds (checked); the region is never a Rust reference's target, so
        // the copy aliases nothing of this process. Which rank writes which bytes, and
        // when, the protocol orders with release/acquire barriers on the region's words.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len())
        }
    }

    /// Copies the region's bytes at `offset` into `dst`; panics beyond the region.
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        self.check(offset, dst.len());
        // SAFETY: in bounds (checked). Another process writing the same bytes meanwhile (a
        // peer breaking the protocol) could only leave other values in `dst`: every bit
        // pattern is a valid `u8`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        }
    }

    /// Copies `src` into the region at byte `offset` (a multiple of 4).
    pub fn write_f32(&self, offset: usize, src: &[f32]) {
        self.check(offset, std::mem::size_of_val(src));
        assert!(offset.is_multiple_of(4), "f32 at unaligned byte {offset}");
        // SAFETY: in bounds and aligned (checked); as in `write`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.ptr.as_ptr().add(offset).cast::<f32>(),
                src.len(),
            )
        }
    }

    /// Copies the region's f32 values at byte `offset` (a multiple of 4) into `dst`.
    pub fn read_f32(&self, offset: usize, dst: &mut [f32]) {
        self.check(offset, std::mem::size_of_val(dst));
        assert!(offset.is_multiple_of(4), "f32 at unaligned byte {offset}");
        // SAFETY: in bounds and aligned (checked); every bit pattern is a valid `f32`, so
        // as in `read` a misbehaving peer can change values, never safety.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset).cast::<f32>(),
                dst.as_mut_ptr(),
                dst.len(),
            )
        }
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of `len` bytes, unmapped once; nothing borrows
        // from it past `self`.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
        if self.owner {
            self.unlink();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn two_mappings_of_one_region_see_each_others_bytes_and_words() {
        let path = shared_dir().join(format!("ferrite-shm-test-{}", std::process::id()));
        let a = SharedRegion::create(&path, 4096).expect("creates");
        let b = SharedRegion::open(&path).expect("opens");
        assert_eq!(b.len(), 4096);
        a.write_f32(64, &[1.5, -2.25]);
        let mut v = [0f32; 2];
        b.read_f32(64, &mut v);
        assert_eq!(v, [1.5, -2.25]);
        b.word(1).fetch_add(3, Ordering::AcqRel);
        assert_eq!(a.word(1).load(Ordering::Acquire), 3);
        assert!(
            SharedRegion::create(&path, 4096).is_err(),
            "never reuses a name"
        );
        let huge = shared_dir().join(format!("ferrite-shm-huge-{}", std::process::id()));
        let err = SharedRegion::create(&huge, usize::MAX >> 2).expect_err("cannot fit");
        assert!(err.to_string().contains("MiB free"), "{err}");
        assert!(!huge.exists());
        drop(b);
        drop(a);
        assert!(!path.exists(), "the creator removes the file");
    }

    #[test]
    fn a_region_opened_while_it_is_being_created_is_never_found_short() {
        // A peer polls for the region while its creator makes it; whenever the name is
        // there, the whole region must be.
        for i in 0..2000 {
            let path = shared_dir().join(format!("ferrite-shm-race-{}-{i}", std::process::id()));
            let poll = path.clone();
            let polling = std::sync::Arc::new(std::sync::Barrier::new(2));
            let started = polling.clone();
            let peer = std::thread::spawn(move || {
                started.wait();
                loop {
                    match SharedRegion::open(&poll) {
                        Ok(r) => return Ok(r.len()),
                        Err(e) if e.kind() == io::ErrorKind::NotFound => std::hint::spin_loop(),
                        Err(e) => return Err(e.to_string()),
                    }
                }
            });
            polling.wait();
            let region = SharedRegion::create(&path, 1 << 16).expect("creates");
            assert_eq!(peer.join().expect("peer"), Ok(1 << 16), "attempt {i}");
            drop(region);
        }
        // Neither a region nor its staging name outlives the creator.
        let prefix = format!("ferrite-shm-race-{}-", std::process::id());
        let leftovers: Vec<_> = std::fs::read_dir(shared_dir())
            .expect("lists")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with(&prefix))
            .collect();
        assert!(
            leftovers.is_empty(),
            "{} files left behind, such as {:?}",
            leftovers.len(),
            &leftovers[..leftovers.len().min(3)]
        );
    }
}
