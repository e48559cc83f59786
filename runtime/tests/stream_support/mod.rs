//! A producer written in Rust for the stream tests: it speaks the wire protocol byte by byte, so the
//! protocol's tests need no Python, and it can misbehave on purpose (lie, stall, vanish).
#![allow(dead_code)] // each test target uses a different subset

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use safetensors::Dtype;
use safetensors::tensor::TensorView;

use draftpipe_runtime::source::stream::wire::{Hello, PROTOCOL_VERSION, Reply};

/// One message's tensors: `(name, dtype, shape, values)`.
pub type Tensors = Vec<(&'static str, Dtype, Vec<usize>, Vec<f64>)>;

/// A safetensors blob of `tensors`, made by the reference writer.
pub fn blob(tensors: &Tensors) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, dtype, _, v)| super::source_support::encode(*dtype, v))
        .collect();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, dtype, shape, _), b)| {
            (
                name.to_string(),
                TensorView::new(*dtype, shape.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// The order of a message's tensors in its blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// The reference writer's (by dtype: `hidden_states` before `loss_mask`): the server reads it whole.
    Reference,
    /// `hidden_states` last, as the Python client writes it: one-item messages are received into the batch.
    HiddenLast,
}

/// Both layouts, for tests that must hold for either path through the server.
pub const LAYOUTS: [Layout; 2] = [Layout::Reference, Layout::HiddenLast];

/// A safetensors blob of `tensors` in `layout`.
pub fn blob_in(layout: Layout, tensors: &Tensors) -> Vec<u8> {
    if layout == Layout::Reference {
        return blob(tensors);
    }
    let mut ordered: Vec<_> = tensors.iter().collect();
    ordered.sort_by_key(|(name, ..)| *name == "hidden_states");
    let data: Vec<Vec<u8>> = ordered
        .iter()
        .map(|(_, dtype, _, v)| super::source_support::encode(*dtype, v))
        .collect();
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for ((name, dtype, shape, _), bytes) in ordered.iter().zip(&data) {
        let entry = serde_json::json!({
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + bytes.len()],
        });
        header.insert(name.to_string(), entry);
        offset += bytes.len();
    }
    let mut header = serde_json::to_vec(&header).unwrap();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut blob = (header.len() as u64).to_le_bytes().to_vec();
    blob.extend_from_slice(&header);
    data.iter().for_each(|bytes| blob.extend_from_slice(bytes));
    blob
}

/// `rows × seq` random-ish hidden states (bf16-exact values), ids and a mask that keeps `lens[r]` tokens.
pub fn batch(
    rows: usize,
    seq: usize,
    din: usize,
    vocab: usize,
    lens: &[usize],
    salt: u64,
) -> Tensors {
    let mut state = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let hs: Vec<f64> = (0..rows * seq * din)
        .map(|_| ((next() % 512) as f64 - 256.0) / 64.0)
        .collect();
    let ids: Vec<f64> = (0..rows * seq)
        .map(|_| (next() % vocab as u64) as f64)
        .collect();
    let mask: Vec<f64> = (0..rows * seq)
        .map(|i| f64::from(u8::from(i % seq < lens[i / seq])))
        .collect();
    vec![
        ("hidden_states", Dtype::BF16, vec![rows, seq, din], hs),
        ("input_ids", Dtype::I64, vec![rows, seq], ids),
        ("loss_mask", Dtype::U8, vec![rows, seq], mask),
    ]
}

/// The client's socket: TCP, or a unix socket for `unix:/path` addresses.
pub enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A raw client connection.
pub struct Client {
    pub stream: Socket,
}

impl Client {
    pub fn connect(address: &str) -> Self {
        let stream = match address.strip_prefix("unix:") {
            Some(path) => Socket::Unix(UnixStream::connect(path).unwrap()),
            None => Socket::Tcp(TcpStream::connect(address).unwrap()),
        };
        let mut client = Self { stream };
        client.set_timeout(Duration::from_secs(20));
        client
    }

    pub fn set_timeout(&mut self, timeout: Duration) {
        match &self.stream {
            Socket::Tcp(s) => s.set_read_timeout(Some(timeout)).unwrap(),
            Socket::Unix(s) => s.set_read_timeout(Some(timeout)).unwrap(),
        }
    }

    /// This end's address, as the server logs it.
    pub fn local_name(&self) -> String {
        match &self.stream {
            Socket::Tcp(s) => s.local_addr().unwrap().to_string(),
            Socket::Unix(_) => String::new(),
        }
    }

    pub fn hello_for(hidden: usize, taps: usize, vocab: usize, token: &str, name: &str) -> Hello {
        Hello {
            protocol: PROTOCOL_VERSION,
            hidden,
            tap_layers: (0..taps as u32).collect(),
            vocab,
            token: token.into(),
            producer: Some(name.into()),
        }
    }

    pub fn frame(&mut self, body: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(&(body.len() as u64).to_le_bytes())?;
        self.stream.write_all(body)
    }

    pub fn hello(&mut self, hello: &Hello) -> Reply {
        self.frame(&serde_json::to_vec(hello).unwrap()).unwrap();
        self.reply()
    }

    /// The next reply; an error reply with "(connection closed)" when the server hung up without one.
    pub fn reply(&mut self) -> Reply {
        let mut len = [0u8; 8];
        if self.stream.read_exact(&mut len).is_err() {
            return Reply::error("(connection closed)");
        }
        let mut body = vec![0u8; u64::from_le_bytes(len) as usize];
        self.stream.read_exact(&mut body).unwrap();
        serde_json::from_slice(&body).unwrap()
    }

    pub fn send(&mut self, tensors: &Tensors) -> Reply {
        self.send_in(Layout::Reference, tensors)
    }

    pub fn send_in(&mut self, layout: Layout, tensors: &Tensors) -> Reply {
        match self.frame(&blob_in(layout, tensors)) {
            Ok(()) => self.reply(),
            Err(e) => Reply::error(format!("(send failed: {e})")),
        }
    }

    pub fn done(&mut self) -> Reply {
        self.frame(&[]).unwrap();
        self.reply()
    }
}
