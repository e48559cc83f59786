//! The syntax tree of a `.pipe` file: what the grammar recognised, with a [`Span`] on every node.
//!
//! The AST does not interpret values (units, ranges, which keys exist): that is the checker's job, so one
//! pass can report every problem of a file at once.

use crate::span::Span;

/// A name, with where it was written.
#[derive(Debug, Clone, PartialEq)]
pub struct Ident {
    /// The name.
    pub name: String,
    /// Where it appears.
    pub span: Span,
}

/// A whole `.pipe` file.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineFile {
    /// Top-level sections in source order.
    pub sections: Vec<Section>,
    /// The whole file.
    pub span: Span,
}

/// One top-level section.
#[derive(Debug, Clone, PartialEq)]
pub enum Section {
    /// `pipeline "NAME"`.
    Pipeline(PipelineDecl),
    /// `devices { ... }`.
    Devices(DevicesSection),
    /// `target NAME on DEVICES { ... }`.
    Target(StageSection),
    /// `queue NAME from A to B { ... }`.
    Queue(QueueSection),
    /// `drafter NAME on DEVICES { ... }`.
    Drafter(StageSection),
    /// `telemetry { ... }`.
    Telemetry(TelemetrySection),
    /// `acceptance { ... }`.
    Acceptance(AcceptanceSection),
    /// Any other `word ... { ... }`, kept so the checker can name it.
    Unknown(UnknownSection),
}

impl Section {
    /// The section's span.
    pub fn span(&self) -> Span {
        match self {
            Section::Pipeline(s) => s.span,
            Section::Devices(s) => s.span,
            Section::Target(s) | Section::Drafter(s) => s.span,
            Section::Queue(s) => s.span,
            Section::Telemetry(s) => s.span,
            Section::Acceptance(s) => s.span,
            Section::Unknown(s) => s.span,
        }
    }
}

/// `pipeline "NAME"`.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineDecl {
    /// The pipeline's name.
    pub name: StringLit,
    /// The whole declaration.
    pub span: Span,
}

/// A string literal with escapes resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct StringLit {
    /// The string's value.
    pub value: String,
    /// Where it appears, quotes included.
    pub span: Span,
}

/// `devices { gpu 0..8 { memory = 141GiB } ... }`.
#[derive(Debug, Clone, PartialEq)]
pub struct DevicesSection {
    /// Device declarations in source order.
    pub decls: Vec<DeviceDecl>,
    /// The whole section.
    pub span: Span,
}

/// One device declaration: `gpu 0..8 { memory = 141GiB }` or `cpu { memory = 64GiB }`.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceDecl {
    /// `cpu` or `gpu`.
    pub class: Ident,
    /// Device ordinals (a number, range or list), when written.
    pub ids: Option<Value>,
    /// Settings.
    pub block: Block,
    /// The whole declaration.
    pub span: Span,
}

/// `target` and `drafter` sections: a named stage placed on devices.
#[derive(Debug, Clone, PartialEq)]
pub struct StageSection {
    /// Stage name.
    pub name: Ident,
    /// Where its workers run.
    pub placement: PlacementExpr,
    /// Settings.
    pub block: Block,
    /// The header `target NAME on DEVICES`.
    pub header: Span,
    /// The whole section.
    pub span: Span,
}

/// `cpu`, `cpu x4`, `gpu 0..5`, `gpu 3` or `gpu [0, 2]`.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacementExpr {
    /// `cpu` or `gpu`.
    pub class: Ident,
    /// `xN`: the worker count (`None` when the digits overflow), with its span.
    pub workers: Option<(Option<u64>, Span)>,
    /// Device ordinals (a number, range or list).
    pub ids: Option<Value>,
    /// The whole placement.
    pub span: Span,
}

/// `queue NAME from A to B { ... }`.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueSection {
    /// Queue name.
    pub name: Ident,
    /// Producer stage.
    pub from: Ident,
    /// Consumer stage.
    pub to: Ident,
    /// Settings.
    pub block: Block,
    /// The header `queue NAME from A to B`.
    pub header: Span,
    /// The whole section.
    pub span: Span,
}

/// `telemetry { ... }`.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetrySection {
    /// Settings.
    pub block: Block,
    /// The keyword.
    pub header: Span,
    /// The whole section.
    pub span: Span,
}

/// `acceptance { ... }`: the held-out prompts and the target the draft-and-verify loop measures the drafter with.
#[derive(Debug, Clone, PartialEq)]
pub struct AcceptanceSection {
    /// Settings.
    pub block: Block,
    /// The keyword.
    pub header: Span,
    /// The whole section.
    pub span: Span,
}

/// A section whose keyword the language does not know.
#[derive(Debug, Clone, PartialEq)]
pub struct UnknownSection {
    /// The unknown keyword.
    pub keyword: Ident,
    /// Its block.
    pub block: Block,
    /// The whole section.
    pub span: Span,
}

/// `{ key = value ... }`.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    /// Entries in source order (duplicates kept; the checker reports them).
    pub entries: Vec<Entry>,
    /// Braces included.
    pub span: Span,
}

/// `key = value`, in a block or as a call argument.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// The key.
    pub key: Ident,
    /// The value.
    pub value: Value,
    /// The whole entry.
    pub span: Span,
}

/// A value with its span.
#[derive(Debug, Clone, PartialEq)]
pub struct Value {
    /// What was written.
    pub kind: ValueKind,
    /// Where.
    pub span: Span,
}

/// The kinds of value the grammar knows.
#[derive(Debug, Clone, PartialEq)]
pub enum ValueKind {
    /// An integer literal.
    Integer(i64),
    /// A literal with a fraction or exponent.
    Float(f64),
    /// A number with a unit suffix: `141GiB`, `1s`.
    Quantity {
        /// The number before the unit.
        amount: f64,
        /// The unit as written.
        unit: Ident,
    },
    /// A string literal.
    Str(String),
    /// A half-open range `start..end`.
    Range(Box<Value>, Box<Value>),
    /// `[a, b, ...]`.
    List(Vec<Value>),
    /// `(a, b, ...)`.
    Tuple(Vec<Value>),
    /// `name(key = value, ...)`.
    Call(Call),
    /// `env("NAME")`: the value of an environment variable, read when the plan runs.
    Env(StringLit),
    /// A bare name such as `random_in_bucket`.
    Ident(String),
    /// A literal the parser already reported (e.g. an integer that overflows); checks skip it silently.
    Invalid,
}

/// `name(key = value, ...)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The function name.
    pub name: Ident,
    /// Arguments in source order.
    pub args: Vec<Entry>,
    /// The whole call.
    pub span: Span,
}
