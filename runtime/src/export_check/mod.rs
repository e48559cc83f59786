//! `draftpipe export-check`: whether SGLang and vLLM would load a `dflash` or `eagle3` export, by their loaders'
//! own rules, read from their code (each rule cites the file and function it mirrors). An export whose
//! `config.json` names `LlamaForCausalLMEagle3` gets the EAGLE-3 rules (`eagle3.rs`), any other the DFlash ones.
//!
//! ```text
//!  DIR/config.json ──config rules──┐
//!  DIR/*.safetensors headers ──────┼──▶ per engine: loads | loads, with warnings | does not load (and why)
//!  --tokenizer tokenizer.json ─────┘
//! ```
//!
//! Nothing is loaded into a model: the check reads `config.json`, the safetensors headers of the files each
//! engine would read, and optionally the target's tokenizer, and applies what each loader does with them: which
//! tensor names it maps, skips or rejects, the config keys it requires, `target_layer_ids` against
//! `num_target_layers`, the mask token against the vocabulary and the tokenizer, and the block size against the
//! speculative token count. The rules are those of SGLang's `python/sglang/srt/models/dflash.py` and
//! `speculative/dflash_utils.py` / `dflash_worker.py`, and vLLM's `model_executor/models/qwen3_dflash.py`,
//! `v1/spec_decode/` and `model_loader/default_loader.py`, as of the versions this was written against
//! (December 2026: sgl-project/sglang `models/dflash.py` at 003b23d, `speculative/dflash_utils.py` at 00731f0,
//! `speculative/dflash_worker.py` at 7f151c5 and its later `_resolve_mask_token_id`; vllm-project/vllm
//! `models/qwen3_dflash.py` at 036a00d, `v1/spec_decode/dflash.py` at 01046b9); a newer engine may accept more.

mod config;
mod eagle3;
mod tensors;
mod tokenizer;

use std::fmt;
use std::path::{Path, PathBuf};

pub use config::DflashConfig;
pub use tokenizer::{TokenizerError, TokenizerVocab};

/// A serving engine whose DFlash loader the check applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// SGLang (`--speculative-algorithm DFLASH`).
    Sglang,
    /// vLLM (`--speculative-config '{"method": "dflash", …}'`).
    Vllm,
}

impl Engine {
    /// Both engines, in report order.
    pub const ALL: [Engine; 2] = [Engine::Sglang, Engine::Vllm];

    /// The engine's name as its users write it.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Sglang => "SGLang",
            Engine::Vllm => "vLLM",
        }
    }
}

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// The engine loads the export, but something deserves a look (it may serve worse than it trained).
    Warning,
    /// The engine refuses the export, or loads it wrongly (a tensor silently skipped, a mask token it cannot
    /// embed): served, it would not draft what it was trained to.
    Fatal,
}

/// One thing an engine's loader would do with the export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The engine.
    pub engine: Engine,
    /// How bad it is.
    pub severity: Severity,
    /// What happens and why, naming the file and the key or tensor.
    pub message: String,
}

/// The verdict for one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Loads as trained.
    Loads,
    /// Loads; see the warnings.
    LoadsWithWarnings,
    /// Does not load, or loads wrongly.
    DoesNotLoad,
}

/// What the caller knows about how the export will be served.
#[derive(Debug, Clone, Default)]
pub struct CheckOptions {
    /// The target's tokenizer (`tokenizer.json`, or a directory holding one).
    pub tokenizer: Option<PathBuf>,
    /// The speculative token count the engine will be started with, vLLM's meaning: `num_speculative_tokens`
    /// (mask slots after the anchor; SGLang's `--speculative-num-draft-tokens` is this plus one).
    pub speculative_tokens: Option<usize>,
}

/// The result of checking one export directory.
#[derive(Debug, Clone)]
pub struct ExportReport {
    /// The directory checked.
    pub dir: PathBuf,
    /// Every finding, per engine, in the order found.
    pub findings: Vec<Finding>,
    /// The block size the config gives (SGLang's default 16 when it gives none), for the serve flags.
    pub block_size: Option<usize>,
}

impl ExportReport {
    /// The verdict for `engine`.
    pub fn verdict(&self, engine: Engine) -> Verdict {
        let worst = self
            .findings
            .iter()
            .filter(|f| f.engine == engine)
            .map(|f| f.severity)
            .max();
        match worst {
            None => Verdict::Loads,
            Some(Severity::Warning) => Verdict::LoadsWithWarnings,
            Some(Severity::Fatal) => Verdict::DoesNotLoad,
        }
    }

    /// True when every engine loads the export (warnings allowed).
    pub fn all_load(&self) -> bool {
        Engine::ALL
            .iter()
            .all(|&e| self.verdict(e) != Verdict::DoesNotLoad)
    }

    /// The findings for `engine`.
    pub fn findings_for(&self, engine: Engine) -> impl Iterator<Item = &Finding> {
        self.findings.iter().filter(move |f| f.engine == engine)
    }
}

impl fmt::Display for ExportReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "export-check {}", self.dir.display())?;
        for engine in Engine::ALL {
            let verdict = match self.verdict(engine) {
                Verdict::Loads => "loads",
                Verdict::LoadsWithWarnings => "loads, with warnings",
                Verdict::DoesNotLoad => "does not load",
            };
            writeln!(f, "  {:<7} {verdict}", format!("{}:", engine.name()))?;
            for finding in self.findings_for(engine) {
                let mark = match finding.severity {
                    Severity::Fatal => "error",
                    Severity::Warning => "warning",
                };
                writeln!(f, "    {mark}: {}", finding.message)?;
            }
        }
        if let Some(block) = self.block_size {
            writeln!(
                f,
                "  serve as trained: SGLang --speculative-num-draft-tokens {block}; vLLM \"num_speculative_tokens\": {}",
                block.saturating_sub(1)
            )?;
        }
        Ok(())
    }
}

/// Why the check could not run at all (a bad export is a report, not an error).
#[derive(Debug, thiserror::Error)]
pub enum ExportCheckError {
    /// The path is not a directory.
    #[error("{}: not a directory (give the directory `--save` wrote)", path.display())]
    NotADirectory {
        /// The path given.
        path: PathBuf,
    },
    /// The tokenizer given could not be read.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// Collects findings; a rule that applies to both engines records one per engine.
#[derive(Debug, Default)]
pub(crate) struct Findings(Vec<Finding>);

impl Findings {
    pub(crate) fn push(&mut self, engine: Engine, severity: Severity, message: impl Into<String>) {
        self.0.push(Finding {
            engine,
            severity,
            message: message.into(),
        });
    }

    pub(crate) fn both(&mut self, severity: Severity, message: impl Into<String>) {
        let message = message.into();
        for engine in Engine::ALL {
            self.push(engine, severity, message.clone());
        }
    }

    pub(crate) fn fatal(&mut self, engine: Engine, message: impl Into<String>) {
        self.push(engine, Severity::Fatal, message);
    }
}

/// Checks the export in `dir` for every engine.
///
/// # Errors
/// [`ExportCheckError`] when `dir` is not a directory or the tokenizer given is unreadable.
pub fn check_export(dir: &Path, options: &CheckOptions) -> Result<ExportReport, ExportCheckError> {
    if !dir.is_dir() {
        return Err(ExportCheckError::NotADirectory {
            path: dir.to_path_buf(),
        });
    }
    let tokenizer = options
        .tokenizer
        .as_deref()
        .map(TokenizerVocab::read)
        .transpose()?;
    let mut findings = Findings::default();
    if eagle3::is_eagle3(dir) {
        eagle3::check(dir, options, &mut findings);
        return Ok(ExportReport {
            dir: dir.to_path_buf(),
            findings: findings.0,
            block_size: None,
        });
    }
    let config = config::check(dir, &mut findings);
    if let Some(config) = &config {
        config::check_serving(config, options, tokenizer.as_ref(), &mut findings);
    }
    tensors::check(dir, config.as_ref(), &mut findings);
    Ok(ExportReport {
        dir: dir.to_path_buf(),
        findings: findings.0,
        block_size: config.as_ref().map(|c| c.block_size),
    })
}
