//! The stream protocol's framing and control messages, and the sockets it runs over.
//!
//! ```text
//!  producer                                   draftpipe
//!  frame(hello JSON)                 ──▶      checked: protocol, hidden, tap_layers, vocab, token
//!                                    ◀──      frame(reply JSON: ok, slot, max_message_bytes, delivered)
//!  frame(safetensors blob)           ──▶      checked like a file, bucketed, pushed into the queue
//!                                    ◀──      frame(ack JSON) once every batch of it is in the queue
//!  frame(empty) = done               ──▶      ◀── frame(ack JSON, done)
//! ```
//!
//! A frame is an 8-byte little-endian length and that many bytes, the way a safetensors file starts its
//! header. Control messages are JSON; data are safetensors blobs, so there is no tensor encoding of our own.
//! Any error is one reply `{"ok": false, "error": "..."}`, after which the server closes the connection.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The protocol version this server speaks.
pub const PROTOCOL_VERSION: u32 = 1;

/// The largest hello accepted: a hello is a few hundred bytes of JSON.
pub const MAX_HELLO_BYTES: u64 = 64 << 10;

/// How often a blocked read wakes to look at the stop flag.
pub(super) const POLL: Duration = Duration::from_millis(50);

/// What a producer says first.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    /// Must equal [`PROTOCOL_VERSION`].
    pub protocol: u32,
    /// The target's hidden size.
    pub hidden: usize,
    /// The tapped layers, in the order their hidden states are concatenated.
    pub tap_layers: Vec<u32>,
    /// The target's vocabulary size.
    pub vocab: usize,
    /// The shared token (empty when the server has none).
    #[serde(default)]
    pub token: String,
    /// A stable name for this producer: a reconnect with the same name continues its count.
    #[serde(default)]
    pub producer: Option<String>,
}

/// The server's answer to a hello, a message or `done`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Reply {
    /// False on an error; the connection then closes.
    pub ok: bool,
    /// What was wrong, when `ok` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Hello: the producer slot this connection fills.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<usize>,
    /// Hello: the largest message accepted, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_message_bytes: Option<u64>,
    /// Hello: the largest bucket's length; a longer sequence is refused, so producers truncate or split to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub largest_bucket: Option<usize>,
    /// Hello: the plan's `batch_tokens` (token slots of one queue item), what a producer may gather per message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_tokens: Option<usize>,
    /// Hello and acks: messages of this producer acknowledged so far (over reconnects).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivered: Option<u64>,
    /// Ack: queue items this message became.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batches: Option<u64>,
    /// Ack: sequences of this message that were queued (rows with no kept token are dropped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequences: Option<u64>,
    /// The run has ended (its step limit, a signal or an error): the producer should stop, not reconnect.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ended: bool,
    /// Ack of `done`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub done: bool,
}

impl Reply {
    /// An error reply.
    pub fn error(message: impl Into<String>) -> Self {
        Self {
            ok: false,
            error: Some(message.into()),
            ..Self::default()
        }
    }
}

/// What a producer still connected is told when the run stops.
pub const RUN_ENDED: &str = "the run has ended";

/// Why reading from or writing to a peer failed.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The peer closed the connection between frames.
    #[error("the producer closed the connection")]
    Closed,
    /// The peer closed the connection inside a frame.
    #[error("connection closed after {got} of {expected} bytes of a frame")]
    Truncated {
        /// Bytes received.
        got: u64,
        /// Bytes announced (8 for the length prefix itself).
        expected: u64,
    },
    /// No byte arrived for the read timeout in the middle of a frame.
    #[error("no data for {timeout:?} after {got} of {expected} bytes of a frame (read timeout)")]
    Stalled {
        /// Bytes received.
        got: u64,
        /// Bytes announced.
        expected: u64,
        /// The timeout.
        timeout: Duration,
    },
    /// The frame announces more bytes than allowed.
    #[error("a frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The run is stopping.
    #[error("the run is stopping")]
    Stopped,
    /// A control message is not the JSON expected.
    #[error("malformed {what}: {detail}")]
    Malformed {
        /// Which message.
        what: &'static str,
        /// The parser's words.
        detail: String,
    },
    /// The socket failed.
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
}

/// A listening socket: TCP or Unix.
#[derive(Debug)]
pub enum Listener {
    /// `IP:PORT`.
    Tcp(TcpListener),
    /// `unix:/path` (the file is removed when the listener is dropped).
    Unix(UnixListener, PathBuf),
}

impl Listener {
    /// Binds `listen` (`IP:PORT`, `localhost:PORT` or `unix:/path`), non-blocking so the acceptor can stop.
    pub fn bind(listen: &str) -> io::Result<Self> {
        let listener = if let Some(path) = listen.strip_prefix("unix:") {
            let path = PathBuf::from(path);
            // A socket file left by a killed run would make bind fail; only a socket is removed.
            if std::fs::symlink_metadata(&path)
                .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
            {
                std::fs::remove_file(&path)?;
            }
            Self::Unix(UnixListener::bind(&path)?, path)
        } else {
            let address = match listen.strip_prefix("localhost:") {
                Some(port) => format!("127.0.0.1:{port}"),
                None => listen.to_string(),
            };
            Self::Tcp(TcpListener::bind(address)?)
        };
        match &listener {
            Self::Tcp(l) => l.set_nonblocking(true)?,
            Self::Unix(l, _) => l.set_nonblocking(true)?,
        }
        Ok(listener)
    }

    /// The bound address as producers should write it (`127.0.0.1:40123`, `unix:/path`).
    pub fn address(&self) -> String {
        match self {
            Self::Tcp(l) => l
                .local_addr()
                .map_or_else(|_| "?".into(), |a| a.to_string()),
            Self::Unix(_, path) => format!("unix:{}", path.display()),
        }
    }

    /// A pending connection, or `None` when there is none now.
    pub fn accept(&self) -> io::Result<Option<Connection>> {
        let accepted = match self {
            Self::Tcp(l) => l.accept().map(|(stream, peer)| {
                let _ = stream.set_nodelay(true);
                Connection::new(Socket::Tcp(stream), peer.to_string())
            }),
            Self::Unix(l, path) => l.accept().map(|(stream, _)| {
                Connection::new(Socket::Unix(stream), format!("unix:{}", path.display()))
            }),
        };
        match accepted {
            Ok(connection) => connection.map(Some),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Self::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[derive(Debug)]
enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.flush(),
            Self::Unix(s) => s.flush(),
        }
    }
}

/// One producer's connection, with its peer address for the logs.
#[derive(Debug)]
pub struct Connection {
    socket: Socket,
    peer: String,
}

impl Connection {
    fn new(socket: Socket, peer: String) -> io::Result<Self> {
        match &socket {
            Socket::Tcp(s) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(POLL))?;
            }
            Socket::Unix(s) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(POLL))?;
            }
        }
        Ok(Self { socket, peer })
    }

    /// Bounds every write (replies, acknowledgements): a producer that stops reading cannot hold the run.
    pub fn set_write_timeout(&self, timeout: Duration) -> io::Result<()> {
        match &self.socket {
            Socket::Tcp(s) => s.set_write_timeout(Some(timeout)),
            Socket::Unix(s) => s.set_write_timeout(Some(timeout)),
        }
    }

    /// The peer's address (`IP:PORT`, or the socket path for a Unix socket).
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Reads one frame into `buf` (grown as needed, never shrunk) and returns its length. Waits for the first
    /// byte as long as `keep_waiting` says so (checked every [`POLL`]); once a frame has begun, every
    /// `timeout` must bring some bytes. A frame over `max` is refused before its body is read.
    pub fn read_frame(
        &mut self,
        buf: &mut Vec<u8>,
        max: u64,
        timeout: Duration,
        keep_waiting: impl FnMut() -> bool,
    ) -> Result<usize, WireError> {
        let len = self.read_frame_len(max, timeout, keep_waiting)?;
        let len = len as usize;
        if buf.len() < len {
            buf.resize(len, 0);
        }
        self.read_frame_body(&mut buf[..len], 0, len as u64, timeout)?;
        Ok(len)
    }

    /// Reads the length prefix of the next frame, waiting for its first byte as long as `keep_waiting` says
    /// so; a length over `max` is refused before any of the body is read. The body is then read with
    /// [`Self::read_frame_body`], in as many pieces as the reader likes.
    pub fn read_frame_len(
        &mut self,
        max: u64,
        timeout: Duration,
        mut keep_waiting: impl FnMut() -> bool,
    ) -> Result<u64, WireError> {
        let mut prefix = [0u8; 8];
        self.read_full(&mut prefix, 0, 8, timeout, &mut keep_waiting)?;
        let len = u64::from_le_bytes(prefix);
        if len > max {
            return Err(WireError::TooLarge { len, max });
        }
        Ok(len)
    }

    /// Fills `out` with the body bytes `at..at + out.len()` of a frame whose body is `len` bytes; every
    /// `timeout` must bring some bytes, and errors count bytes from the start of the frame.
    pub fn read_frame_body(
        &mut self,
        out: &mut [u8],
        at: u64,
        len: u64,
        timeout: Duration,
    ) -> Result<(), WireError> {
        self.read_full(out, 8 + at, 8 + len, timeout, &mut || true)
    }

    /// Fills `out`; `offset` bytes of the frame came before it and the frame is `expected` bytes in all.
    fn read_full(
        &mut self,
        out: &mut [u8],
        offset: u64,
        expected: u64,
        timeout: Duration,
        keep_waiting: &mut dyn FnMut() -> bool,
    ) -> Result<(), WireError> {
        let mut filled = 0;
        let mut last_progress = Instant::now();
        while filled < out.len() {
            match self.socket.read(&mut out[filled..]) {
                Ok(0) if filled == 0 && offset == 0 => return Err(WireError::Closed),
                Ok(0) => {
                    return Err(WireError::Truncated {
                        got: offset + filled as u64,
                        expected,
                    });
                }
                Ok(n) => {
                    filled += n;
                    last_progress = Instant::now();
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    if filled == 0 && offset == 0 {
                        if !keep_waiting() {
                            return Err(WireError::Stopped);
                        }
                    } else if last_progress.elapsed() >= timeout {
                        return Err(WireError::Stalled {
                            got: offset + filled as u64,
                            expected,
                            timeout,
                        });
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Reads one JSON control frame of at most [`MAX_HELLO_BYTES`].
    pub fn read_json<T: for<'de> Deserialize<'de>>(
        &mut self,
        what: &'static str,
        timeout: Duration,
        stop: &AtomicBool,
    ) -> Result<T, WireError> {
        let mut buf = Vec::new();
        let started = Instant::now();
        let len = self.read_frame(&mut buf, MAX_HELLO_BYTES, timeout, || {
            !stop.load(Ordering::Relaxed) && started.elapsed() < timeout
        })?;
        serde_json::from_slice(&buf[..len]).map_err(|e| WireError::Malformed {
            what,
            detail: e.to_string(),
        })
    }

    /// Writes one reply frame, in one write: with `TCP_NODELAY` two writes are two segments, and a producer
    /// waiting for its acknowledgement would be woken twice.
    pub fn send(&mut self, reply: &Reply) -> Result<(), WireError> {
        let mut frame = vec![0; 8];
        serde_json::to_writer(&mut frame, reply).map_err(io::Error::other)?;
        let len = (frame.len() - 8) as u64;
        frame[..8].copy_from_slice(&len.to_le_bytes());
        self.socket.write_all(&frame)?;
        self.socket.flush()?;
        Ok(())
    }

    /// Sends an error reply (best effort: the peer may be gone) and closes the connection.
    pub fn refuse(mut self, message: &str) {
        let _ = self.send(&Reply::error(message));
        self.close();
    }

    /// Closes both directions.
    pub fn close(self) {
        let _ = match &self.socket {
            Socket::Tcp(s) => s.shutdown(Shutdown::Both),
            Socket::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }
}
