//! Reading files whose paths come from requests and job configs (datasets, eval sets, value
//! heads, checkpoints): regular files only, of bounded size, so that a path such as
//! `/dev/zero`, a FIFO or a huge file is an error naming it instead of a read that never
//! ends or takes the server's memory (docs/ARCHITECTURE.md, invariants).

use std::io::{self, Read};
use std::path::Path;

/// Datasets and eval sets (JSON lines).
pub const MAX_DATASET_BYTES: u64 = 1 << 30;
/// Small JSON or safetensors files: trainer state, value heads.
pub const MAX_SMALL_FILE_BYTES: u64 = 64 << 20;
/// Checkpoint tensors (the optimizer state of a 7B model is ~56 GB).
pub const MAX_CHECKPOINT_BYTES: u64 = 256 << 30;

/// The bytes of `path` when it is a regular file (symlinks followed) of at most `limit`
/// bytes. Errors (`io::ErrorKind::InvalidInput`): not a regular file (a device, FIFO,
/// socket or folder), larger than `limit` (also when it grows past it while read); and
/// the usual open/read errors.
pub fn read_bounded(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"));
    }
    let too_big =
        |n: u64| io::Error::new(io::ErrorKind::InvalidInput, format!("{n} bytes exceed the limit of {limit}"));
    if meta.len() > limit {
        return Err(too_big(meta.len()));
    }
    let mut buf = Vec::with_capacity(meta.len() as usize);
    std::fs::File::open(path)?.take(limit + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > limit {
        return Err(too_big(buf.len() as u64));
    }
    Ok(buf)
}

/// [`read_bounded`] as UTF-8 text (`InvalidData` when it is not).
pub fn read_bounded_string(path: &Path, limit: u64) -> io::Result<String> {
    String::from_utf8(read_bounded(path, limit)?)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("not UTF-8 text: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_within_the_limit() {
        let dir = std::env::temp_dir().join(format!("rlserve-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("a.jsonl");
        std::fs::write(&f, "0123456789").unwrap();
        assert_eq!(read_bounded(&f, 10).unwrap(), b"0123456789");
        let e = read_bounded(&f, 9).unwrap_err();
        assert_eq!(e.to_string(), "10 bytes exceed the limit of 9");
        assert_eq!(read_bounded(Path::new("/dev/zero"), 1 << 20).unwrap_err().to_string(), "not a regular file");
        assert_eq!(read_bounded(&dir, 1 << 20).unwrap_err().to_string(), "not a regular file");
        std::fs::write(&f, [0xff, 0xfe]).unwrap();
        assert!(read_bounded_string(&f, 10).unwrap_err().to_string().starts_with("not UTF-8 text"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
