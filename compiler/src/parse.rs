//! From text to AST: pest recognises the grammar (`grammar.pest`), then one `parse_<rule>` function per rule
//! turns its pairs into spanned [`ast`](crate::ast) nodes.
//!
//! ```text
//!  text ──pest (grammar.pest)──▶ pairs ──parse_<rule>──▶ PipelineFile
//!             └── failure ──▶ syntax::recover (one error per broken section) ──▶ Diagnostics
//! ```

use pest::Parser as _;
use pest::iterators::Pair;

use crate::ast::*;
use crate::diagnostic::{Diagnostic, Diagnostics};
use crate::grammar::{PipeParser, Rule};
use crate::span::Span;
use crate::syntax;

/// Values nest (lists of tuples of calls...); deeper than this is certainly a mistake, and refusing it keeps
/// the recursive lowering's stack use bounded.
const MAX_NESTING: usize = 32;

/// Parses `source` into an AST, or returns every syntax error found.
///
/// # Examples
///
/// ```
/// let file = draftpipe_compiler::parse("x.pipe", "pipeline \"x\"\ntelemetry { every = 2s }").unwrap();
/// assert_eq!(file.sections.len(), 2);
/// ```
pub fn parse(file_name: &str, source: &str) -> Result<PipelineFile, Diagnostics> {
    let mut diagnostics = Diagnostics::new(file_name, source);
    match PipeParser::parse(Rule::file, source) {
        Ok(mut pairs) => {
            let mut lower = Lower::default();
            let file = pairs.next().map(|pair| lower.parse_file(pair));
            diagnostics.extend(lower.errors);
            match file {
                Some(file) if diagnostics.is_empty() => Ok(file),
                _ => Err(diagnostics),
            }
        }
        Err(error) => {
            diagnostics.extend(syntax::recover(source, &error));
            Err(diagnostics)
        }
    }
}

/// Lowers pairs to AST nodes, collecting literal errors (overflowing integers, too deep nesting).
#[derive(Default)]
struct Lower {
    errors: Vec<Diagnostic>,
    depth: usize,
}

impl Lower {
    fn parse_file(&mut self, pair: Pair<'_, Rule>) -> PipelineFile {
        let span = pair.as_span().into();
        let sections = pair
            .into_inner()
            .filter(|p| p.as_rule() != Rule::EOI)
            .map(|p| self.parse_section(p))
            .collect();
        PipelineFile { sections, span }
    }

    fn parse_section(&mut self, pair: Pair<'_, Rule>) -> Section {
        match pair.as_rule() {
            Rule::pipeline_decl => Section::Pipeline(self.parse_pipeline_decl(pair)),
            Rule::devices_section => Section::Devices(self.parse_devices_section(pair)),
            Rule::target_section => Section::Target(self.parse_target_section(pair)),
            Rule::queue_section => Section::Queue(self.parse_queue_section(pair)),
            Rule::drafter_section => Section::Drafter(self.parse_drafter_section(pair)),
            Rule::telemetry_section => Section::Telemetry(self.parse_telemetry_section(pair)),
            Rule::acceptance_section => Section::Acceptance(self.parse_acceptance_section(pair)),
            Rule::unknown_section => Section::Unknown(self.parse_unknown_section(pair)),
            rule => unreachable!("grammar: section cannot be {rule:?}"),
        }
    }

    fn parse_pipeline_decl(&mut self, pair: Pair<'_, Rule>) -> PipelineDecl {
        let span = pair.as_span().into();
        let name = self.parse_string(
            children(pair, Rule::string)
                .next()
                .expect("grammar: pipeline name"),
        );
        PipelineDecl { name, span }
    }

    fn parse_devices_section(&mut self, pair: Pair<'_, Rule>) -> DevicesSection {
        let span = pair.as_span().into();
        let decls = children(pair, Rule::device_decl)
            .map(|p| self.parse_device_decl(p))
            .collect();
        DevicesSection { decls, span }
    }

    fn parse_device_decl(&mut self, pair: Pair<'_, Rule>) -> DeviceDecl {
        let span = pair.as_span().into();
        let (mut class, mut ids, mut block) = (None, None, None);
        for p in pair.into_inner() {
            match p.as_rule() {
                Rule::device_class => class = Some(parse_ident(p)),
                Rule::device_ids => ids = Some(self.parse_device_ids(p)),
                Rule::block => block = Some(self.parse_block(p)),
                _ => {}
            }
        }
        DeviceDecl {
            class: class.expect("grammar: device class"),
            ids,
            block: block.expect("grammar: device block"),
            span,
        }
    }

    fn parse_target_section(&mut self, pair: Pair<'_, Rule>) -> StageSection {
        self.parse_stage(pair)
    }

    fn parse_drafter_section(&mut self, pair: Pair<'_, Rule>) -> StageSection {
        self.parse_stage(pair)
    }

    /// `target` and `drafter` share one shape: `KEYWORD NAME on PLACEMENT { ... }`.
    fn parse_stage(&mut self, pair: Pair<'_, Rule>) -> StageSection {
        let span: Span = pair.as_span().into();
        let (mut name, mut placement, mut block) = (None, None, None);
        for p in pair.into_inner() {
            match p.as_rule() {
                Rule::ident => name = Some(parse_ident(p)),
                Rule::placement => placement = Some(self.parse_placement(p)),
                Rule::block => block = Some(self.parse_block(p)),
                _ => {}
            }
        }
        let placement: PlacementExpr = placement.expect("grammar: stage placement");
        StageSection {
            name: name.expect("grammar: stage name"),
            header: Span::new(span.start, placement.span.end),
            placement,
            block: block.expect("grammar: stage block"),
            span,
        }
    }

    fn parse_placement(&mut self, pair: Pair<'_, Rule>) -> PlacementExpr {
        let span = pair.as_span().into();
        let (mut class, mut workers, mut ids) = (None, None, None);
        for p in pair.into_inner() {
            match p.as_rule() {
                Rule::device_class => class = Some(parse_ident(p)),
                Rule::worker_count => workers = Some(self.parse_worker_count(p)),
                Rule::device_ids => ids = Some(self.parse_device_ids(p)),
                _ => {}
            }
        }
        PlacementExpr {
            class: class.expect("grammar: device class"),
            workers,
            ids,
            span,
        }
    }

    fn parse_worker_count(&mut self, pair: Pair<'_, Rule>) -> (Option<u64>, Span) {
        let span: Span = pair.as_span().into();
        let count = pair.as_str()[1..].parse::<u64>().ok();
        if count.is_none() {
            self.errors.push(
                Diagnostic::error(span, "worker count is too large")
                    .label("does not fit in 64 bits")
                    .help("write `cpu xN` with a small N"),
            );
        }
        (count, span)
    }

    fn parse_device_ids(&mut self, pair: Pair<'_, Rule>) -> Value {
        let inner = pair.into_inner().next().expect("grammar: device ids");
        self.parse_value_kind(inner)
    }

    fn parse_queue_section(&mut self, pair: Pair<'_, Rule>) -> QueueSection {
        let span: Span = pair.as_span().into();
        let mut idents = Vec::with_capacity(3);
        let mut block = None;
        for p in pair.into_inner() {
            match p.as_rule() {
                Rule::ident => idents.push(parse_ident(p)),
                Rule::block => block = Some(self.parse_block(p)),
                _ => {}
            }
        }
        let [name, from, to]: [Ident; 3] =
            idents.try_into().expect("grammar: queue NAME from A to B");
        QueueSection {
            header: Span::new(span.start, to.span.end),
            name,
            from,
            to,
            block: block.expect("grammar"),
            span,
        }
    }

    fn parse_telemetry_section(&mut self, pair: Pair<'_, Rule>) -> TelemetrySection {
        let span = pair.as_span().into();
        let mut inner = pair.into_inner();
        let header = inner
            .next()
            .expect("grammar: telemetry keyword")
            .as_span()
            .into();
        let block = self.parse_block(inner.next().expect("grammar: telemetry block"));
        TelemetrySection {
            block,
            header,
            span,
        }
    }

    fn parse_acceptance_section(&mut self, pair: Pair<'_, Rule>) -> AcceptanceSection {
        let span = pair.as_span().into();
        let mut inner = pair.into_inner();
        let header = inner
            .next()
            .expect("grammar: acceptance keyword")
            .as_span()
            .into();
        let block = self.parse_block(inner.next().expect("grammar: acceptance block"));
        AcceptanceSection {
            block,
            header,
            span,
        }
    }

    fn parse_unknown_section(&mut self, pair: Pair<'_, Rule>) -> UnknownSection {
        let span = pair.as_span().into();
        let mut inner = pair.into_inner();
        let keyword = parse_ident(inner.next().expect("grammar: section keyword"));
        let block = self.parse_block(inner.last().expect("grammar: section block"));
        UnknownSection {
            keyword,
            block,
            span,
        }
    }

    fn parse_block(&mut self, pair: Pair<'_, Rule>) -> Block {
        let span = pair.as_span().into();
        let entries = children(pair, Rule::entry)
            .map(|p| self.parse_entry(p))
            .collect();
        Block { entries, span }
    }

    fn parse_entry(&mut self, pair: Pair<'_, Rule>) -> Entry {
        let span = pair.as_span().into();
        let mut inner = pair.into_inner().filter(|p| p.as_rule() != Rule::equals);
        let key = parse_ident(inner.next().expect("grammar: entry key"));
        let value = self.parse_value(inner.next().expect("grammar: entry value"));
        Entry { key, value, span }
    }

    fn parse_argument(&mut self, pair: Pair<'_, Rule>) -> Entry {
        self.parse_entry(pair)
    }

    fn parse_value(&mut self, pair: Pair<'_, Rule>) -> Value {
        let inner = pair
            .into_inner()
            .next()
            .expect("grammar: value has one alternative");
        self.parse_value_kind(inner)
    }

    /// Dispatches on the alternative a `value` (or `device_ids`) matched.
    fn parse_value_kind(&mut self, pair: Pair<'_, Rule>) -> Value {
        let span: Span = pair.as_span().into();
        if self.depth >= MAX_NESTING {
            self.errors.push(
                Diagnostic::error(span, "values are nested too deeply").help(format!(
                    "nest lists, tuples and calls at most {MAX_NESTING} deep"
                )),
            );
            return Value {
                kind: ValueKind::Invalid,
                span,
            };
        }
        self.depth += 1;
        let kind = match pair.as_rule() {
            Rule::env_ref => ValueKind::Env(
                self.parse_string(
                    children(pair, Rule::string)
                        .next()
                        .expect("grammar: env_ref holds a string"),
                ),
            ),
            Rule::call => ValueKind::Call(self.parse_call(pair)),
            Rule::tuple => ValueKind::Tuple(self.parse_tuple(pair)),
            Rule::list => ValueKind::List(self.parse_list(pair)),
            Rule::range => self.parse_range(pair),
            Rule::quantity => self.parse_quantity(pair),
            Rule::number => self.parse_number(pair),
            Rule::string => ValueKind::Str(self.parse_string(pair).value),
            Rule::ident => ValueKind::Ident(parse_ident(pair).name),
            rule => unreachable!("grammar: value cannot be {rule:?}"),
        };
        self.depth -= 1;
        Value { kind, span }
    }

    fn parse_call(&mut self, pair: Pair<'_, Rule>) -> Call {
        let span = pair.as_span().into();
        let mut inner = pair.into_inner();
        let name = parse_ident(inner.next().expect("grammar: call name"));
        let args = inner
            .filter(|p| p.as_rule() == Rule::argument)
            .map(|p| self.parse_argument(p))
            .collect();
        Call { name, args, span }
    }

    fn parse_tuple(&mut self, pair: Pair<'_, Rule>) -> Vec<Value> {
        children(pair, Rule::value)
            .map(|p| self.parse_value(p))
            .collect()
    }

    fn parse_list(&mut self, pair: Pair<'_, Rule>) -> Vec<Value> {
        children(pair, Rule::value)
            .map(|p| self.parse_value(p))
            .collect()
    }

    fn parse_range(&mut self, pair: Pair<'_, Rule>) -> ValueKind {
        let mut bounds = pair.into_inner().map(|p| {
            let span = p.as_span().into();
            Value {
                kind: self.parse_number(p),
                span,
            }
        });
        let start = bounds.next().expect("grammar: range start");
        let end = bounds.next().expect("grammar: range end");
        ValueKind::Range(Box::new(start), Box::new(end))
    }

    fn parse_quantity(&mut self, pair: Pair<'_, Rule>) -> ValueKind {
        let mut inner = pair.into_inner();
        let number = inner.next().expect("grammar: quantity number");
        let unit = self.parse_unit(inner.next().expect("grammar: quantity unit"));
        match self.parse_number(number) {
            ValueKind::Integer(i) => ValueKind::Quantity {
                amount: i as f64,
                unit,
            },
            ValueKind::Float(x) => ValueKind::Quantity { amount: x, unit },
            _ => ValueKind::Invalid,
        }
    }

    fn parse_unit(&mut self, pair: Pair<'_, Rule>) -> Ident {
        parse_ident(pair)
    }

    /// Integers stay exact (`i64`); a fraction or exponent makes a float.
    fn parse_number(&mut self, pair: Pair<'_, Rule>) -> ValueKind {
        let text = pair.as_str();
        let span: Span = pair.as_span().into();
        if text.contains(['.', 'e', 'E']) {
            match text.parse::<f64>() {
                Ok(x) if x.is_finite() => return ValueKind::Float(x),
                _ => self
                    .errors
                    .push(Diagnostic::error(span, "number is too large").label("not a finite f64")),
            }
        } else {
            match text.parse::<i64>() {
                Ok(i) => return ValueKind::Integer(i),
                Err(_) => self.errors.push(
                    Diagnostic::error(span, "integer is too large")
                        .label("does not fit in 64 bits")
                        .help("integers must lie in -9223372036854775808..=9223372036854775807"),
                ),
            }
        }
        ValueKind::Invalid
    }

    /// Resolves `\"`, `\\`, `\n` and `\t`; other escapes are an error.
    fn parse_string(&mut self, pair: Pair<'_, Rule>) -> StringLit {
        let span: Span = pair.as_span().into();
        let inner = pair.into_inner().next().expect("grammar: string body");
        let body_start = inner.as_span().start();
        let mut value = String::with_capacity(inner.as_str().len());
        let mut chars = inner.as_str().char_indices();
        while let Some((_, c)) = chars.next() {
            if c != '\\' {
                value.push(c);
                continue;
            }
            match chars.next() {
                Some((_, 'n')) => value.push('\n'),
                Some((_, 't')) => value.push('\t'),
                Some((_, c @ ('"' | '\\'))) => value.push(c),
                Some((i, c)) => {
                    let at = body_start + i - 1;
                    self.errors.push(
                        Diagnostic::error(
                            Span::new(at, at + 1 + c.len_utf8()),
                            format!("unknown escape `\\{c}`"),
                        )
                        .label("unknown escape")
                        .help("strings know the escapes \\\", \\\\, \\n and \\t"),
                    );
                }
                None => {}
            }
        }
        StringLit { value, span }
    }
}

fn parse_ident(pair: Pair<'_, Rule>) -> Ident {
    Ident {
        name: pair.as_str().to_owned(),
        span: pair.as_span().into(),
    }
}

fn children<'i>(pair: Pair<'i, Rule>, rule: Rule) -> impl Iterator<Item = Pair<'i, Rule>> {
    pair.into_inner().filter(move |p| p.as_rule() == rule)
}
