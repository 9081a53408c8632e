//! The JSON subset flight-recorder dumps and `chorus trace --json` use:
//! `null`, booleans, unsigned integers, strings, arrays and objects.
//!
//! Numbers are exact `u64`s rather than `f64`s because dumps carry unix
//! nanoseconds, which need more than the 53 bits a double holds. The parser
//! reads untrusted files: it never panics, bounds its nesting, and reports
//! every problem as a [`JsonError`] with its byte offset.

use std::fmt::{self, Write as _};

use thiserror::Error;

/// Deepest nesting [`parse`] accepts; dumps nest three deep, so anything
/// near this is garbage, and the bound keeps recursion off the stack limit.
pub const MAX_DEPTH: usize = 32;

/// A JSON value of the supported subset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// An unsigned integer.
    UInt(u64),
    /// A string.
    Str(String),
    /// An array.
    Array(Vec<Value>),
    /// An object, members in document order.
    Object(Vec<(String, Value)>),
}

impl Value {
    /// An object from `(key, value)` pairs, in order.
    pub fn object<'a>(members: impl IntoIterator<Item = (&'a str, Value)>) -> Value {
        Value::Object(
            members
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        )
    }

    /// The member `key` of an object (the first, if repeated).
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Object(members) => members.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The integer, if this is one.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::UInt(n) => Some(*n),
            _ => None,
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The elements, if this is an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(items) => Some(items),
            _ => None,
        }
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Str(s.to_string())
    }
}

impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::Str(s)
    }
}

impl From<u64> for Value {
    fn from(n: u64) -> Self {
        Value::UInt(n)
    }
}

impl From<usize> for Value {
    fn from(n: usize) -> Self {
        Value::UInt(n as u64)
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Self {
        v.map_or(Value::Null, Into::into)
    }
}

/// Compact JSON, on one line (strings escape every control character).
impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Null => f.write_str("null"),
            Value::Bool(b) => write!(f, "{b}"),
            Value::UInt(n) => write!(f, "{n}"),
            Value::Str(s) => write_string(f, s),
            Value::Array(items) => {
                f.write_char('[')?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_char(',')?;
                    }
                    write!(f, "{item}")?;
                }
                f.write_char(']')
            }
            Value::Object(members) => {
                f.write_char('{')?;
                for (i, (key, value)) in members.iter().enumerate() {
                    if i > 0 {
                        f.write_char(',')?;
                    }
                    write_string(f, key)?;
                    write!(f, ":{value}")?;
                }
                f.write_char('}')
            }
        }
    }
}

/// Writes `s` as a JSON string literal.
fn write_string(f: &mut impl fmt::Write, s: &str) -> fmt::Result {
    f.write_char('"')?;
    for c in s.chars() {
        match c {
            '"' => f.write_str("\\\"")?,
            '\\' => f.write_str("\\\\")?,
            '\n' => f.write_str("\\n")?,
            '\r' => f.write_str("\\r")?,
            '\t' => f.write_str("\\t")?,
            c if c.is_control() => write!(f, "\\u{:04x}", c as u32)?,
            c => f.write_char(c)?,
        }
    }
    f.write_char('"')
}

/// Why bytes are not a JSON document of the supported subset.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum JsonError {
    /// The input ended inside a value: the file was truncated.
    #[error("unexpected end of input at byte {0} (truncated?)")]
    End(usize),
    /// A byte no value of the subset can start or continue with.
    #[error("unexpected byte 0x{found:02x} at byte {offset}; expected {expected}")]
    Unexpected {
        /// Where.
        offset: usize,
        /// The byte found.
        found: u8,
        /// What would have been valid there.
        expected: &'static str,
    },
    /// A number that is negative, fractional or above `u64::MAX`.
    #[error("number at byte {0} is not an unsigned 64-bit integer")]
    Number(usize),
    /// A malformed `\` escape in a string.
    #[error("invalid escape in string at byte {0}")]
    Escape(usize),
    /// A string that is not UTF-8.
    #[error("string at byte {0} is not valid UTF-8")]
    Utf8(usize),
    /// Arrays and objects nested deeper than [`MAX_DEPTH`].
    #[error("values nested deeper than {MAX_DEPTH} at byte {0}")]
    Depth(usize),
    /// Bytes after the document.
    #[error("trailing data at byte {0}")]
    Trailing(usize),
}

/// Parses one JSON document (surrounding whitespace allowed).
pub fn parse(input: &[u8]) -> Result<Value, JsonError> {
    let mut parser = Parser { s: input, i: 0 };
    let value = parser.value(0)?;
    parser.skip_ws();
    if parser.i != input.len() {
        return Err(JsonError::Trailing(parser.i));
    }
    Ok(value)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.i) {
            self.i += 1;
        }
    }

    /// The next non-space byte, not consumed.
    fn peek(&mut self) -> Result<u8, JsonError> {
        self.skip_ws();
        self.s.get(self.i).copied().ok_or(JsonError::End(self.i))
    }

    fn expect(&mut self, byte: u8, expected: &'static str) -> Result<(), JsonError> {
        let found = self.peek()?;
        if found != byte {
            return Err(JsonError::Unexpected {
                offset: self.i,
                found,
                expected,
            });
        }
        self.i += 1;
        Ok(())
    }

    fn literal(&mut self, word: &[u8], value: Value) -> Result<Value, JsonError> {
        for &expected in word {
            match self.s.get(self.i) {
                None => return Err(JsonError::End(self.i)),
                Some(&found) if found != expected => {
                    return Err(JsonError::Unexpected {
                        offset: self.i,
                        found,
                        expected: "true, false or null",
                    });
                }
                Some(_) => self.i += 1,
            }
        }
        Ok(value)
    }

    fn value(&mut self, depth: usize) -> Result<Value, JsonError> {
        match self.peek()? {
            b'{' | b'[' if depth >= MAX_DEPTH => Err(JsonError::Depth(self.i)),
            b'{' => self.object(depth + 1),
            b'[' => self.array(depth + 1),
            b'"' => self.string().map(Value::Str),
            b't' => self.literal(b"true", Value::Bool(true)),
            b'f' => self.literal(b"false", Value::Bool(false)),
            b'n' => self.literal(b"null", Value::Null),
            b'0'..=b'9' | b'-' => self.number(),
            found => Err(JsonError::Unexpected {
                offset: self.i,
                found,
                expected: "a value",
            }),
        }
    }

    fn object(&mut self, depth: usize) -> Result<Value, JsonError> {
        self.i += 1;
        let mut members = Vec::new();
        if self.peek()? == b'}' {
            self.i += 1;
            return Ok(Value::Object(members));
        }
        loop {
            if self.peek()? != b'"' {
                return Err(JsonError::Unexpected {
                    offset: self.i,
                    found: self.s[self.i],
                    expected: "a member name",
                });
            }
            let key = self.string()?;
            self.expect(b':', "':'")?;
            members.push((key, self.value(depth)?));
            match self.peek()? {
                b',' => self.i += 1,
                b'}' => {
                    self.i += 1;
                    return Ok(Value::Object(members));
                }
                found => {
                    return Err(JsonError::Unexpected {
                        offset: self.i,
                        found,
                        expected: "',' or '}'",
                    });
                }
            }
        }
    }

    fn array(&mut self, depth: usize) -> Result<Value, JsonError> {
        self.i += 1;
        let mut items = Vec::new();
        if self.peek()? == b']' {
            self.i += 1;
            return Ok(Value::Array(items));
        }
        loop {
            items.push(self.value(depth)?);
            match self.peek()? {
                b',' => self.i += 1,
                b']' => {
                    self.i += 1;
                    return Ok(Value::Array(items));
                }
                found => {
                    return Err(JsonError::Unexpected {
                        offset: self.i,
                        found,
                        expected: "',' or ']'",
                    });
                }
            }
        }
    }

    fn number(&mut self) -> Result<Value, JsonError> {
        let start = self.i;
        while let Some(b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E') = self.s.get(self.i) {
            self.i += 1;
        }
        let digits = &self.s[start..self.i];
        // JSON forbids leading zeros; digits only, so it is ASCII.
        if digits.len() > 1 && digits[0] == b'0' || !digits.iter().all(u8::is_ascii_digit) {
            return Err(JsonError::Number(start));
        }
        std::str::from_utf8(digits)
            .ok()
            .and_then(|d| d.parse().ok())
            .map(Value::UInt)
            .ok_or(JsonError::Number(start))
    }

    /// A string literal; `self.i` is at its opening quote.
    fn string(&mut self) -> Result<String, JsonError> {
        let start = self.i;
        self.i += 1;
        let mut out = Vec::new();
        loop {
            let Some(&byte) = self.s.get(self.i) else {
                return Err(JsonError::End(self.i));
            };
            self.i += 1;
            match byte {
                b'"' => return String::from_utf8(out).map_err(|_| JsonError::Utf8(start)),
                b'\\' => {
                    let at = self.i - 1;
                    let escape = *self.s.get(self.i).ok_or(JsonError::End(self.i))?;
                    self.i += 1;
                    let c = match escape {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => self.unicode_escape(at)?,
                        _ => return Err(JsonError::Escape(at)),
                    };
                    out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                }
                // Raw control characters are invalid inside JSON strings.
                0..=0x1f => return Err(JsonError::Escape(self.i - 1)),
                _ => out.push(byte),
            }
        }
    }

    /// The character of a `\uXXXX` escape (the `\u` consumed), joining a
    /// surrogate pair.
    fn unicode_escape(&mut self, at: usize) -> Result<char, JsonError> {
        let high = self.hex4(at)?;
        let code = if (0xd800..0xdc00).contains(&high) {
            if self.s.get(self.i..self.i + 2) != Some(b"\\u") {
                return Err(JsonError::Escape(at));
            }
            self.i += 2;
            let low = self.hex4(at)?;
            if !(0xdc00..0xe000).contains(&low) {
                return Err(JsonError::Escape(at));
            }
            0x10000 + ((high - 0xd800) << 10) + (low - 0xdc00)
        } else {
            high
        };
        char::from_u32(code).ok_or(JsonError::Escape(at))
    }

    fn hex4(&mut self, at: usize) -> Result<u32, JsonError> {
        let hex = self
            .s
            .get(self.i..self.i + 4)
            .ok_or(JsonError::End(self.s.len()))?;
        self.i += 4;
        std::str::from_utf8(hex)
            .ok()
            .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .ok_or(JsonError::Escape(at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_through_display_and_parse() {
        let value = Value::object([
            ("null", Value::Null),
            ("yes", true.into()),
            ("max", u64::MAX.into()),
            (
                "text",
                "quote \" backslash \\ newline \n tab \t bell \u{7} é 🎵".into(),
            ),
            (
                "list",
                Value::Array(vec![0u64.into(), Value::Array(vec![]), Value::object([])]),
            ),
        ]);
        let text = value.to_string();
        assert!(!text.contains('\n'), "one line: {text}");
        assert_eq!(parse(text.as_bytes()), Ok(value));
    }

    #[test]
    fn standard_escapes_and_surrogate_pairs_decode() {
        let parsed = parse(br#" ["\u00e9\/\b\f\r", "\ud83c\udfb5"] "#).unwrap();
        assert_eq!(
            parsed,
            Value::Array(vec!["é/\u{8}\u{c}\r".into(), "🎵".into()])
        );
    }

    #[test]
    fn garbage_is_a_typed_error_with_its_offset() {
        let cases: &[(&[u8], JsonError)] = &[
            (b"", JsonError::End(0)),
            (b"{\"a\": [1, 2", JsonError::End(11)),
            (b"\"abc", JsonError::End(4)),
            (
                b"{\"a\" 1}",
                JsonError::Unexpected {
                    offset: 5,
                    found: b'1',
                    expected: "':'",
                },
            ),
            (
                b"{1: 2}",
                JsonError::Unexpected {
                    offset: 1,
                    found: b'1',
                    expected: "a member name",
                },
            ),
            (
                b"[1 2]",
                JsonError::Unexpected {
                    offset: 3,
                    found: b'2',
                    expected: "',' or ']'",
                },
            ),
            (b"nul", JsonError::End(3)),
            (
                b"nope",
                JsonError::Unexpected {
                    offset: 1,
                    found: b'o',
                    expected: "true, false or null",
                },
            ),
            (b"-1", JsonError::Number(0)),
            (b"1.5", JsonError::Number(0)),
            (b"012", JsonError::Number(0)),
            (b"18446744073709551616", JsonError::Number(0)),
            (b"\"\\x\"", JsonError::Escape(1)),
            (b"\"\\ud800\"", JsonError::Escape(1)),
            (b"\"\\u12zz\"", JsonError::Escape(1)),
            (b"\"\\u12", JsonError::End(5)),
            (b"\"a\nb\"", JsonError::Escape(2)),
            (b"\"\xff\"", JsonError::Utf8(0)),
            (b"1 2", JsonError::Trailing(2)),
            (
                b"\x00",
                JsonError::Unexpected {
                    offset: 0,
                    found: 0,
                    expected: "a value",
                },
            ),
        ];
        for (input, expected) in cases {
            assert_eq!(
                parse(input).as_ref(),
                Err(expected),
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn deep_nesting_is_refused_not_a_stack_overflow() {
        let deep = vec![b'['; 100_000];
        assert_eq!(parse(&deep), Err(JsonError::Depth(MAX_DEPTH)));
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(parse(ok.as_bytes()).is_ok());
    }

    #[test]
    fn every_prefix_of_a_document_fails_cleanly() {
        let text = Value::object([(
            "a",
            Value::Array(vec!["x\u{1}".into(), 7u64.into(), Value::Null]),
        )])
        .to_string();
        for end in 0..text.len() {
            assert!(
                parse(&text.as_bytes()[..end]).is_err(),
                "prefix {end} parsed"
            );
        }
    }
}
