//! The part of TensorBoard's `Event` protobuf (`tensorboard/compat/proto/event.proto`, `summary.proto`) an
//! event file of scalars needs, as hand-written `prost` messages: the field numbers are the protos', the
//! fields left out are ones this writer never sets (a reader skips absent fields).
//!
//! ```text
//!  Event { wall_time = 1, step = 2, what: file_version = 3 │ summary = 5 }
//!  Summary { value = 1: [Value { tag = 1, simple_value = 2 }] }
//! ```

/// One event of an event file.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// Seconds since the Unix epoch when it was written.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The training step it belongs to (TensorBoard's x axis).
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// What it carries.
    #[prost(oneof = "What", tags = "3, 5")]
    pub what: Option<What>,
}

/// An event's payload (the protos' `oneof what`, the two members written here).
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    /// The first event of every file: which format follows (`brain.Event:2`).
    #[prost(string, tag = "3")]
    FileVersion(String),
    /// Named values at the event's step.
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// Named values at one step.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    /// The values.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// One scalar: its tag and value (the protos' `Summary.Value` with `simple_value`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    /// The scalar's stable name (docs/telemetry.md).
    #[prost(string, tag = "1")]
    pub tag: String,
    /// Its value (TensorBoard's scalars are f32). Always `Some` when written: in the protos it is a member of
    /// `oneof value`, so it must be on the wire even when it is 0 (a plain proto3 field would leave a 0 out, and
    /// the reader would drop a value with no member set).
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}

/// The version string of the first event, which TensorBoard's loader looks for.
pub const FILE_VERSION: &str = "brain.Event:2";
