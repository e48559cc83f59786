//! The target's tokenizer as the mask-token rules need it: the id of each token and how many there are, read
//! from a Hugging Face `tokenizer.json` (what `tokenizer.get_vocab()` and `len(tokenizer)` give in SGLang).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The tokenizer file of a model directory.
const TOKENIZER_FILE: &str = "tokenizer.json";

/// The largest tokenizer file read (Qwen3's is 11 MB).
const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// Why the tokenizer could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{}: {message}", path.display())]
pub struct TokenizerError {
    /// The file (or directory) given.
    pub path: PathBuf,
    /// What is wrong (with line and column for bad JSON).
    pub message: String,
}

/// Every token of a tokenizer and its id: the model's vocabulary and the added tokens.
#[derive(Debug, Clone)]
pub struct TokenizerVocab {
    path: PathBuf,
    ids: HashMap<String, u64>,
    len: usize,
}

impl TokenizerVocab {
    /// Reads `path`: a `tokenizer.json`, or a directory holding one.
    ///
    /// # Errors
    /// [`TokenizerError`] when the file is missing, too large, not JSON, or has no vocabulary.
    pub fn read(path: &Path) -> Result<Self, TokenizerError> {
        let file = if path.is_dir() {
            path.join(TOKENIZER_FILE)
        } else {
            path.to_path_buf()
        };
        let error = |message: String| TokenizerError {
            path: file.clone(),
            message,
        };
        let size = std::fs::metadata(&file)
            .map_err(|e| error(e.to_string()))?
            .len();
        if size > MAX_TOKENIZER_BYTES {
            return Err(error(format!(
                "{size} bytes, over the limit of {MAX_TOKENIZER_BYTES} for a tokenizer"
            )));
        }
        let text = std::fs::read(&file).map_err(|e| error(e.to_string()))?;
        let json: Value = serde_json::from_slice(&text).map_err(|e| {
            error(format!(
                "line {}, column {}: not JSON: {e}",
                e.line(),
                e.column()
            ))
        })?;
        let mut ids = HashMap::new();
        match json.get("model").and_then(|m| m.get("vocab")) {
            // BPE, WordPiece and WordLevel: `{token: id}`.
            Some(Value::Object(vocab)) => {
                for (token, id) in vocab {
                    let id = id.as_u64().ok_or_else(|| {
                        error(format!("`model.vocab[{token:?}]` is {id}, not an id"))
                    })?;
                    ids.insert(token.clone(), id);
                }
            }
            // Unigram: `[[token, score], …]`, the id being the position.
            Some(Value::Array(vocab)) => {
                for (id, entry) in vocab.iter().enumerate() {
                    let token = entry.get(0).and_then(Value::as_str).ok_or_else(|| {
                        error(format!("`model.vocab[{id}]` is not [token, score]"))
                    })?;
                    ids.insert(token.to_owned(), id as u64);
                }
            }
            _ => {
                return Err(error(
                    "no `model.vocab`: not a tokenizers `tokenizer.json`".to_owned(),
                ));
            }
        }
        for token in json
            .get("added_tokens")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let (Some(id), Some(content)) = (
                token.get("id").and_then(Value::as_u64),
                token.get("content").and_then(Value::as_str),
            ) {
                ids.insert(content.to_owned(), id);
            }
        }
        // `len(tokenizer)`: one past the largest id (ids are dense in every real tokenizer).
        let len = ids.values().max().map_or(0, |&m| m as usize + 1);
        Ok(Self {
            path: file,
            ids,
            len,
        })
    }

    /// The id of `token`, if the tokenizer has it.
    pub fn id_of(&self, token: &str) -> Option<u64> {
        self.ids.get(token).copied()
    }

    /// How many ids the tokenizer uses (`len(tokenizer)`).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a tokenizer with no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file read.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
