//! Python's `json.dumps` layout, which chat templates (transformers' `tojson`) and vLLM's
//! pythonic tool parser write: written here because no crate writes Python's exact float
//! `repr` and escapes (serde_json's formatters come close, not to the byte).

/// Python's `repr` of a finite float.
pub fn float_repr(f: f64) -> String {
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.to_owned();
    }
    let sci = format!("{:e}", f.abs());
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::new();
    if f < 0.0 {
        out.push('-');
    }
    // Python's `float_repr_style == 'short'`: fixed notation when -4 < decpt <= 16.
    let point = exponent + 1;
    if point > -4 && point <= 16 {
        if point <= 0 {
            out.push_str("0.");
            out.push_str(&"0".repeat(point.unsigned_abs() as usize));
            out.push_str(&digits);
        } else {
            let point = point as usize;
            if point >= digits.len() {
                out.push_str(&digits);
                out.push_str(&"0".repeat(point - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..point]);
                out.push('.');
                out.push_str(&digits[point..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exponent < 0 { '-' } else { '+' });
        out.push_str(&format!("{:02}", exponent.unsigned_abs()));
    }
    out
}

/// `s` as a JSON string the way `json.dumps` writes it: `\n`, `\t`... and `\u00XX` for
/// other control characters; with `ensure_ascii`, every non-ASCII character as `\uXXXX`
/// (UTF-16 units), else as it is.
pub fn write_str(s: &str, ensure_ascii: bool, out: &mut String) {
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
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (0.1 + 0.2, "0.30000000000000004"),
            (100.0, "100.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (9_999_999_999_999_998.0, "9999999999999998.0"),
            (1e16, "1e+16"),
            (1e22, "1e+22"),
            (123_456_789.123, "123456789.123"),
            (-2.5, "-2.5"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (5e-324, "5e-324"),
            (1.797_693_134_862_315_7e308, "1.7976931348623157e+308"),
        ];
        for (value, expected) in cases {
            assert_eq!(float_repr(value), expected, "{value:e}");
        }
    }

    #[test]
    fn strings_are_escaped_as_python_escapes_them() {
        let w = |s: &str, ascii: bool| {
            let mut out = String::new();
            write_str(s, ascii, &mut out);
            out
        };
        assert_eq!(
            w("a\"b\\c\n\u{1}é😀", false),
            "\"a\\\"b\\\\c\\n\\u0001é😀\""
        );
        assert_eq!(w("é😀", true), "\"\\u00e9\\ud83d\\ude00\"");
    }
}
