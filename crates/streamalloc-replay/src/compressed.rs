//! Trace files compressed with gzip or xz, read and written transparently: a file is read as
//! gzip or xz when it starts with their magic bytes (whatever its name), and written
//! compressed when its name ends in `.gz` or `.xz`.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::Path;

use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;
use liblzma::read::XzDecoder;
use liblzma::write::XzEncoder;

/// How a trace file is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Plain text.
    None,
    /// gzip (`.gz`).
    Gzip,
    /// xz (`.xz`).
    Xz,
}

/// gzip's first bytes.
const GZIP_MAGIC: &[u8] = &[0x1f, 0x8b];
/// xz's first bytes.
const XZ_MAGIC: &[u8] = &[0xfd, b'7', b'z', b'X', b'Z', 0];

/// The xz preset written: 6, xz's own default.
const XZ_LEVEL: u32 = 6;

impl Compression {
    /// The compression a file named `path` is written with: by its last extension.
    pub fn of_name(path: &Path) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("gz") => Self::Gzip,
            Some(e) if e.eq_ignore_ascii_case("xz") => Self::Xz,
            _ => Self::None,
        }
    }

    /// The compression of a file that starts with `start`.
    fn of_magic(start: &[u8]) -> Self {
        if start.starts_with(GZIP_MAGIC) {
            Self::Gzip
        } else if start.starts_with(XZ_MAGIC) {
            Self::Xz
        } else {
            Self::None
        }
    }
}

/// Opens `path` for reading, decompressed when it starts as gzip or xz does.
pub fn open(path: &Path) -> std::io::Result<Box<dyn BufRead + Send>> {
    const BUFFER: usize = 1 << 16;
    let mut file = BufReader::with_capacity(BUFFER, File::open(path)?);
    // The magic is at most 6 bytes: what one read of a file gives (a shorter file is none).
    let compression = Compression::of_magic(file.fill_buf()?);
    Ok(match compression {
        Compression::None => Box::new(file),
        Compression::Gzip => Box::new(BufReader::with_capacity(BUFFER, MultiGzDecoder::new(file))),
        Compression::Xz => Box::new(BufReader::with_capacity(BUFFER, XzDecoder::new_multi_decoder(file))),
    })
}

/// A file being written, compressed or not; [`Writer::finish`] ends it.
pub enum Writer {
    /// Plain text.
    Plain(BufWriter<File>),
    /// gzip.
    Gzip(GzEncoder<BufWriter<File>>),
    /// xz.
    Xz(XzEncoder<BufWriter<File>>),
}

impl Writer {
    /// Creates (or truncates) `path`, written with `compression`.
    pub fn create(path: &Path, compression: Compression) -> std::io::Result<Self> {
        let file = BufWriter::new(File::create(path)?);
        Ok(match compression {
            Compression::None => Self::Plain(file),
            Compression::Gzip => Self::Gzip(GzEncoder::new(file, flate2::Compression::default())),
            Compression::Xz => Self::Xz(XzEncoder::new(file, XZ_LEVEL)),
        })
    }

    /// Writes the compressed stream's end and flushes the file; its errors are the write's.
    pub fn finish(self) -> std::io::Result<()> {
        let mut file = match self {
            Self::Plain(file) => file,
            Self::Gzip(encoder) => encoder.finish()?,
            Self::Xz(encoder) => encoder.finish()?,
        };
        file.flush()
    }
}

impl Write for Writer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        match self {
            Self::Plain(w) => w.write(bytes),
            Self::Gzip(w) => w.write(bytes),
            Self::Xz(w) => w.write(bytes),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Self::Plain(w) => w.flush(),
            Self::Gzip(w) => w.flush(),
            Self::Xz(w) => w.flush(),
        }
    }
}

/// Copies the plain file `from` into a new file `to`, written with `compression`.
pub fn compress_file(from: &Path, to: &Path, compression: Compression) -> std::io::Result<()> {
    let mut input = File::open(from)?;
    let mut out = Writer::create(to, compression)?;
    let mut buffer = vec![0; 1 << 16];
    loop {
        match input.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => out.write_all(&buffer[..n])?,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    out.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What is written compressed reads back the same, whichever the compression.
    #[test]
    fn written_compressed_reads_back_the_same() {
        let dir = std::env::temp_dir();
        let text = "Thread,Time,Action,Pointer,Size,Stream\n0,1,allocate,0x10,64,0\n".repeat(1000);
        for (name, compression) in
            [("t.csv", Compression::None), ("t.csv.gz", Compression::Gzip), ("t.csv.xz", Compression::Xz)]
        {
            let path = dir.join(format!("streamalloc-compressed-{}-{name}", std::process::id()));
            assert_eq!(Compression::of_name(&path), compression);
            let mut w = Writer::create(&path, compression).unwrap();
            w.write_all(text.as_bytes()).unwrap();
            w.finish().unwrap();
            let written = std::fs::read(&path).unwrap();
            assert_eq!(Compression::of_magic(&written), compression, "{name}");
            let mut back = String::new();
            open(&path).unwrap().read_to_string(&mut back).unwrap();
            let _ = std::fs::remove_file(&path);
            assert_eq!(back, text, "{name}");
        }
    }
}
