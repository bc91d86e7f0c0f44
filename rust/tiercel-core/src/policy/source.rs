//! The source tree: a policy's TOML or JSON values, each with the position where it stood,
//! so that the checker can name the line of every mistake.

use std::fmt;

use serde::de::{Deserialize, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// A value from the source, with the byte offset where it starts (TOML only; toml has no
/// position for implicit tables such as `a` in `[a.b]`).
#[derive(Debug)]
pub(super) struct Node {
    pub(super) pos: Option<usize>,
    pub(super) value: Value,
}

#[derive(Debug)]
pub(super) enum Value {
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    Datetime(String),
    Null,
    List(Vec<Node>),
    /// Entries in source order.
    Table(Vec<(String, Node)>),
}

impl Node {
    fn bare(value: Value) -> Node {
        Node { pos: None, value }
    }

    /// Where this node, or failing that the first of its children, starts.
    pub(super) fn first_pos(&self) -> Option<usize> {
        self.pos.or_else(|| match &self.value {
            Value::List(items) => items.iter().find_map(Node::first_pos),
            Value::Table(entries) => entries.iter().find_map(|(_, n)| n.first_pos()),
            _ => None,
        })
    }

    /// The value as an error message quotes it after "got".
    pub(super) fn describe(&self) -> String {
        match &self.value {
            Value::Str(s) => format!("{s:?}"),
            Value::Int(n) => n.to_string(),
            Value::Float(x) => x.to_string(),
            Value::Bool(b) => b.to_string(),
            Value::Datetime(d) => format!("the date-time {d}"),
            Value::Null => "null".into(),
            Value::List(_) => "a list".into(),
            Value::Table(_) => "a table".into(),
        }
    }
}

impl From<serde_json::Value> for Node {
    fn from(v: serde_json::Value) -> Node {
        use serde_json::Value as J;
        Node::bare(match v {
            J::Null => Value::Null,
            J::Bool(b) => Value::Bool(b),
            // An integer beyond i64 is no valid setting; as a float it is reported as such.
            J::Number(n) => n.as_i64().map_or_else(|| Value::Float(n.as_f64().unwrap_or(f64::NAN)), Value::Int),
            J::String(s) => Value::Str(s),
            J::Array(items) => Value::List(items.into_iter().map(Node::from).collect()),
            J::Object(map) => Value::Table(map.into_iter().map(|(k, v)| (k, Node::from(v))).collect()),
        })
    }
}

// toml 0.8 hands out positions through serde_spanned's protocol: a struct with these magic
// names, answered with a map of start, end and value. We speak it directly rather than use
// `toml::Spanned<T>`, because toml answers an implicit table without a position with its plain
// entries, which `Spanned` rejects; `NodeVisitor` takes either answer.
const SPANNED_NAME: &str = "$__serde_spanned_private_Spanned";
const SPANNED_START: &str = "$__serde_spanned_private_start";
const SPANNED_FIELDS: &[&str] = &[SPANNED_START, "$__serde_spanned_private_end", "$__serde_spanned_private_value"];
/// toml presents a date-time as a map with this single key.
const TOML_DATETIME: &str = "$__toml_private_datetime";

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Node, D::Error> {
        d.deserialize_struct(SPANNED_NAME, SPANNED_FIELDS, NodeVisitor)
    }
}

/// Reads the value inside a span answer without asking for a span again (which would recurse).
struct Unspanned;

impl<'de> DeserializeSeed<'de> for Unspanned {
    type Value = Node;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Node, D::Error> {
        d.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a TOML value")
    }
    fn visit_bool<E>(self, b: bool) -> std::result::Result<Node, E> {
        Ok(Node::bare(Value::Bool(b)))
    }
    fn visit_i64<E>(self, n: i64) -> std::result::Result<Node, E> {
        Ok(Node::bare(Value::Int(n)))
    }
    fn visit_u64<E>(self, n: u64) -> std::result::Result<Node, E> {
        Ok(Node::bare(i64::try_from(n).map_or(Value::Float(n as f64), Value::Int)))
    }
    fn visit_f64<E>(self, x: f64) -> std::result::Result<Node, E> {
        Ok(Node::bare(Value::Float(x)))
    }
    fn visit_str<E>(self, s: &str) -> std::result::Result<Node, E> {
        Ok(Node::bare(Value::Str(s.to_string())))
    }
    fn visit_unit<E>(self) -> std::result::Result<Node, E> {
        Ok(Node::bare(Value::Null))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Node>()? {
            items.push(item);
        }
        Ok(Node::bare(Value::List(items)))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Node, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                SPANNED_START => {
                    // The span answer: start, end, then the value itself.
                    let start: usize = map.next_value()?;
                    map.next_key::<String>()?;
                    map.next_value::<usize>()?;
                    map.next_key::<String>()?;
                    let node = map.next_value_seed(Unspanned)?;
                    return Ok(Node { pos: Some(start), ..node });
                }
                TOML_DATETIME => return Ok(Node::bare(Value::Datetime(map.next_value()?))),
                _ => entries.push((key, map.next_value::<Node>()?)),
            }
        }
        Ok(Node::bare(Value::Table(entries)))
    }
}

/// 1-based line of a byte offset.
pub(super) fn line_of(text: &str, pos: usize) -> usize {
    let end = pos.min(text.len());
    text.as_bytes()[..end].iter().filter(|&&b| b == b'\n').count() + 1
}

impl Node {
    /// The value as JSON (a Python tier's `[tier.options]`, handed to its factory as keywords;
    /// a date-time becomes its text).
    pub(super) fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match &self.value {
            Value::Str(s) | Value::Datetime(s) => J::String(s.clone()),
            Value::Int(n) => J::from(*n),
            Value::Float(x) => serde_json::Number::from_f64(*x).map_or(J::Null, J::Number),
            Value::Bool(b) => J::Bool(*b),
            Value::Null => J::Null,
            Value::List(items) => J::Array(items.iter().map(Node::to_json).collect()),
            Value::Table(entries) => J::Object(entries.iter().map(|(k, n)| (k.clone(), n.to_json())).collect()),
        }
    }
}
