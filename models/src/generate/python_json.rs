//! Template values written as JSON the way Python's `json.dumps` writes them, for the chat
//! templates' `tojson` filter: transformers replaces Jinja's own (which escapes `<`, `>`, `&`
//! and `'` for HTML) with `json.dumps(x, ensure_ascii=False, indent=indent,
//! separators=separators, sort_keys=sort_keys)`, and templates of tool-calling models write
//! tool definitions and call arguments with it (Llama 3.1 with `indent=4`).

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// The `tojson` filter: `json.dumps` with transformers' defaults (`ensure_ascii=False`, key
/// order kept) and its keyword arguments `indent` (spaces or a string), `separators`,
/// `sort_keys` and `ensure_ascii`.
pub(super) fn tojson(value: Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(v.as_i64().and_then(|n| usize::try_from(n).ok()).ok_or_else(|| invalid("indent must be a count or a string"))?)),
        },
    };
    let (item, key) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(pair) if pair.len() == 2 => (pair[0].clone(), pair[1].clone()),
        Some(_) => return Err(invalid("separators must be a pair")),
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let writer = Writer {
        indent,
        item,
        key,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    writer.value(&value, 0, &mut out)?;
    Ok(out)
}

fn invalid(message: &str) -> Error {
    Error::new(ErrorKind::InvalidOperation, format!("tojson: {message}"))
}

struct Writer {
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl Writer {
    fn value(&self, v: &Value, depth: usize, out: &mut String) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
            ValueKind::Number => out.push_str(&python_float(f64::try_from(v.clone())?)),
            ValueKind::String => self.string(v.as_str().unwrap_or_default(), out),
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort_by(|a, b| a.to_string().cmp(&b.to_string()));
                }
                let items = keys.into_iter().map(|k| Ok((k.clone(), v.get_item(&k)?))).collect::<Result<Vec<_>, Error>>()?;
                self.container(('{', '}'), items.len(), depth, out, |i, out| {
                    let (k, item) = &items[i];
                    // Python writes str, int, float, bool and None keys as strings.
                    match k.as_str() {
                        Some(s) => self.string(s, out),
                        None => self.string(&k.to_string(), out),
                    }
                    out.push_str(&self.key);
                    self.value(item, depth + 1, out)
                })?;
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container(('[', ']'), items.len(), depth, out, |i, out| self.value(&items[i], depth + 1, out))?;
            }
            kind => return Err(invalid(&format!("a {kind} is not JSON"))),
        }
        Ok(())
    }

    fn container(&self, (open, close): (char, char), len: usize, depth: usize, out: &mut String, mut each: impl FnMut(usize, &mut String) -> Result<(), Error>) -> Result<(), Error> {
        out.push(open);
        if len == 0 {
            out.push(close);
            return Ok(());
        }
        let newline = |depth: usize, out: &mut String| {
            if let Some(indent) = &self.indent {
                out.push('\n');
                for _ in 0..depth {
                    out.push_str(indent);
                }
            }
        };
        for i in 0..len {
            if i > 0 {
                out.push_str(&self.item);
            }
            newline(depth + 1, out);
            each(i, out)?;
        }
        newline(depth, out);
        out.push(close);
        Ok(())
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A float as Python's `repr` writes it: the shortest digits that read back the same,
/// positional from 1e-4 to 1e16 (`1.0`, `0.001`), else in exponent form (`1e-05`, `1.5e+20`).
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    let abs = x.abs();
    if abs == 0.0 || (1e-4..1e16).contains(&abs) {
        let s = x.to_string();
        return if s.contains('.') { s } else { format!("{s}.0") };
    }
    let s = format!("{x:e}");
    let (mantissa, exponent) = s.split_once('e').expect("exponent form");
    let (sign, digits) = match exponent.strip_prefix('-') {
        Some(d) => ('-', d),
        None => ('+', exponent),
    };
    format!("{mantissa}e{sign}{digits:0>2}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::Environment;

    fn render(template: &str, value: serde_json::Value) -> String {
        let mut env = Environment::new();
        env.add_filter("tojson", tojson);
        env.render_str(template, minijinja::context! { v => Value::from_serialize(value) }).unwrap()
    }

    #[test]
    fn writes_as_python_json_dumps() {
        // json.dumps({"b": [1, 2.5, None, True], "a": "<é\"\n>"}, ensure_ascii=False)
        let v: serde_json::Value = serde_json::from_str(r#"{"b": [1, 2.5, null, true], "a": "<é\"\n>"}"#).unwrap();
        assert_eq!(render("{{ v | tojson }}", v.clone()), r#"{"a": "<é\"\n>", "b": [1, 2.5, null, true]}"#);
        assert_eq!(render("{{ v | tojson(indent=2) }}", v.clone()), "{\n  \"a\": \"<é\\\"\\n>\",\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ]\n}");
        assert_eq!(render("{{ v | tojson(separators=[',', ':'], ensure_ascii=true) }}", v), r#"{"a":"<\u00e9\"\n>","b":[1,2.5,null,true]}"#);
        assert_eq!(render("{{ v | tojson }}", serde_json::json!({"e": {}, "l": []})), r#"{"e": {}, "l": []}"#);
        assert_eq!(render("{{ v | tojson }}", serde_json::json!("😀")), "\"😀\"");
        assert_eq!(render("{{ v | tojson(ensure_ascii=true) }}", serde_json::json!("😀")), r#""\ud83d\ude00""#);
    }

    #[test]
    fn floats_read_as_python_writes_them() {
        let cases = [(1.0, "1.0"), (0.001, "0.001"), (1e-5, "1e-05"), (1.5e20, "1.5e+20"), (1e16, "1e+16"), (-2.5, "-2.5"), (0.0, "0.0"), (123456.789, "123456.789")];
        for (x, want) in cases {
            assert_eq!(python_float(x), want, "{x}");
        }
    }
}
