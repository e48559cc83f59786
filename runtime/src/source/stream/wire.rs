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
use std::net::IpAddr;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
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
    /// Hello: the drafter reads the target's final-norm output (what its `lm_head` consumes), so every message
    /// must carry `last_hidden_states [N, S, hidden]` beside `hidden_states` (absent, and not sent, otherwise).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub last_hidden_states: bool,
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
    /// Error: the refusal is only for now (every handshake or producer slot taken): the producer may try the
    /// hello again after a while.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retry: bool,
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
    /// A frame that must arrive whole within the timeout of the connection's accept (a hello) did not.
    #[error(
        "only {got} of {expected} bytes of a frame arrived within {timeout:?} of connecting (read timeout)"
    )]
    Late {
        /// Bytes received.
        got: u64,
        /// Bytes announced (8 while the length prefix itself is arriving).
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
    /// The run is stopping (nothing of a frame had arrived).
    #[error("the run is stopping")]
    Stopped,
    /// The run is stopping while a frame was arriving: the frame is dropped, not waited for.
    #[error(
        "the run is stopping: this message was not queued ({got} of {expected} bytes had arrived)"
    )]
    Abandoned {
        /// Bytes received.
        got: u64,
        /// Bytes announced.
        expected: u64,
    },
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
            remove_stale_socket(&path)?;
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
                let ip = peer.ip().to_canonical();
                let remote = (!ip.is_loopback()).then_some(ip);
                Connection::new(Socket::Tcp(stream), peer.to_string(), remote)
            }),
            Self::Unix(l, path) => l.accept().map(|(stream, _)| {
                Connection::new(
                    Socket::Unix(stream),
                    format!("unix:{}", path.display()),
                    None,
                )
            }),
        };
        match accepted {
            Ok(connection) => connection.map(Some),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Removes a socket file that a killed run left at `path` (it would make bind fail), and refuses one that a
/// live run listens on, as TCP's "address in use" does: removing it would hand that run's producers to this
/// one. Only a socket is ever removed; anything else at `path` is left for bind to refuse.
fn remove_stale_socket(path: &std::path::Path) -> io::Result<()> {
    let is_socket = std::fs::symlink_metadata(path)
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()));
    if !is_socket {
        return Ok(());
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "address in use: another process is listening on {}",
                path.display()
            ),
        )),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => std::fs::remove_file(path),
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!(
                "cannot tell whether {} is in use ({e}); remove it if no run listens there",
                path.display()
            ),
        )),
    }
}

impl AsRawFd for Listener {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Self::Tcp(l) => l.as_raw_fd(),
            Self::Unix(l, _) => l.as_raw_fd(),
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

/// What a read waits for besides bytes.
struct Wait<'a> {
    /// Asked every [`POLL`] while no byte of a frame has arrived: false gives up ([`WireError::Stopped`]).
    idle: &'a mut dyn FnMut() -> bool,
    /// Asked between reads inside a frame: true gives up ([`WireError::Abandoned`]).
    stop: &'a dyn Fn() -> bool,
}

/// One producer's connection, with its peer address for the logs.
#[derive(Debug)]
pub struct Connection {
    socket: Socket,
    peer: String,
    /// The peer's IP address when it is another machine's (`None`: loopback or a unix socket, this machine).
    remote: Option<IpAddr>,
}

impl Connection {
    fn new(socket: Socket, peer: String, remote: Option<IpAddr>) -> io::Result<Self> {
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
        Ok(Self {
            socket,
            peer,
            remote,
        })
    }

    /// Non-blocking while the acceptor reads its hello among the others; blocking (with the [`POLL`] read
    /// timeout) once a producer slot's thread owns it.
    pub(super) fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        match &self.socket {
            Socket::Tcp(s) => s.set_nonblocking(nonblocking),
            Socket::Unix(s) => s.set_nonblocking(nonblocking),
        }
    }

    /// The peer's IP address when it is another machine's; `None` for loopback and unix sockets.
    pub(super) fn remote(&self) -> Option<IpAddr> {
        self.remote
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
        let mut wait = Wait {
            idle: &mut keep_waiting,
            stop: &|| false,
        };
        self.read_full(&mut prefix, 0, 8, timeout, &mut wait)?;
        let len = u64::from_le_bytes(prefix);
        if len > max {
            return Err(WireError::TooLarge { len, max });
        }
        Ok(len)
    }

    /// Fills `out` with the body bytes `at..at + out.len()` of a frame whose body is `len` bytes; every
    /// `timeout` must bring some bytes, and errors count bytes from the start of the frame. `stop` is asked
    /// between reads: a run that is ending abandons the frame ([`WireError::Abandoned`]) rather than wait for
    /// a producer in the middle of a message.
    pub fn read_frame_body(
        &mut self,
        out: &mut [u8],
        (at, len): (u64, u64),
        timeout: Duration,
        stop: &dyn Fn() -> bool,
    ) -> Result<(), WireError> {
        let mut wait = Wait {
            idle: &mut || true,
            stop,
        };
        self.read_full(out, 8 + at, 8 + len, timeout, &mut wait)
    }

    /// Fills `out`; `offset` bytes of the frame came before it and the frame is `expected` bytes in all.
    fn read_full(
        &mut self,
        out: &mut [u8],
        offset: u64,
        expected: u64,
        timeout: Duration,
        wait: &mut Wait<'_>,
    ) -> Result<(), WireError> {
        let mut filled = 0;
        let mut last_progress = Instant::now();
        while filled < out.len() {
            let got = offset + filled as u64;
            if got > 0 && (wait.stop)() {
                return Err(WireError::Abandoned { got, expected });
            }
            match self.socket.read(&mut out[filled..]) {
                Ok(0) if got == 0 => return Err(WireError::Closed),
                Ok(0) => return Err(WireError::Truncated { got, expected }),
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
                    if got == 0 {
                        if !(wait.idle)() {
                            return Err(WireError::Stopped);
                        }
                    } else if last_progress.elapsed() >= timeout {
                        return Err(WireError::Stalled {
                            got,
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
    pub fn refuse(self, message: &str) {
        self.refuse_with(Reply::error(message));
    }

    /// Sends `reply` (best effort) and closes the connection.
    pub fn refuse_with(mut self, reply: Reply) {
        let _ = self.send(&reply);
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

impl AsRawFd for Connection {
    fn as_raw_fd(&self) -> RawFd {
        match &self.socket {
            Socket::Tcp(s) => s.as_raw_fd(),
            Socket::Unix(s) => s.as_raw_fd(),
        }
    }
}

/// A control frame (a hello) of at most [`MAX_HELLO_BYTES`] read as its bytes arrive on a non-blocking
/// connection, so one thread can read the hellos of every waiting connection.
#[derive(Debug, Default)]
pub(super) struct PartialFrame {
    bytes: Vec<u8>,
}

impl PartialFrame {
    /// Bytes of the frame received so far (the length prefix included).
    pub(super) fn received(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// Bytes of the whole frame: 8 until the length prefix is in, then 8 + its length.
    pub(super) fn expected(&self) -> u64 {
        match self.bytes.get(..8) {
            Some(prefix) => {
                8 + u64::from_le_bytes(prefix.try_into().expect("an 8-byte length prefix"))
            }
            None => 8,
        }
    }

    /// Reads what has arrived without waiting: the frame's body once it is whole, `None` while more is to come.
    ///
    /// # Errors
    /// [`WireError::Closed`] (nothing of the frame came), [`WireError::Truncated`], [`WireError::TooLarge`] (the
    /// length over [`MAX_HELLO_BYTES`], refused before its body is read), [`WireError::Io`].
    pub(super) fn read_from(
        &mut self,
        connection: &mut Connection,
    ) -> Result<Option<Vec<u8>>, WireError> {
        let mut chunk = [0u8; 4096];
        loop {
            let expected = self.expected();
            if self.bytes.len() == 8 && expected - 8 > MAX_HELLO_BYTES {
                return Err(WireError::TooLarge {
                    len: expected - 8,
                    max: MAX_HELLO_BYTES,
                });
            }
            let missing = expected - self.received();
            if missing == 0 && self.bytes.len() >= 8 {
                return Ok(Some(self.bytes.split_off(8)));
            }
            let want = chunk.len().min(missing as usize);
            match connection.socket.read(&mut chunk[..want]) {
                Ok(0) if self.bytes.is_empty() => return Err(WireError::Closed),
                Ok(0) => {
                    return Err(WireError::Truncated {
                        got: self.received(),
                        expected,
                    });
                }
                Ok(n) => self.bytes.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn socket_path(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("draftpipe-wire-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("hs.sock")
    }

    #[test]
    fn a_live_unix_socket_is_refused_and_kept() {
        let path = socket_path("live");
        let listen = format!("unix:{}", path.display());
        let first = Listener::bind(&listen).unwrap();
        let second = Listener::bind(&listen).unwrap_err();
        assert_eq!(second.kind(), io::ErrorKind::AddrInUse, "{second}");
        assert!(second.to_string().contains("address in use"), "{second}");
        // The first run still owns its socket: a producer reaches it.
        let _client = UnixStream::connect(&path).unwrap();
        assert!(first.accept().unwrap().is_some());
    }

    #[test]
    fn a_stale_unix_socket_is_replaced() {
        let path = socket_path("stale");
        drop(UnixListener::bind(&path).unwrap());
        assert!(path.exists(), "std leaves the socket file behind");
        let listener = Listener::bind(&format!("unix:{}", path.display())).unwrap();
        let _client = UnixStream::connect(&path).unwrap();
        assert!(listener.accept().unwrap().is_some());
    }
}
