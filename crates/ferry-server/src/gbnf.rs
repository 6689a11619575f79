//! GBNF, llama.cpp's grammar format (what vLLM's default structured-output backends and
//! llama.cpp take as `grammar`), translated into the Lark dialect llguidance compiles.
//!
//! GBNF has rules `name ::= expression`, an expression being alternatives (`|`) of sequences
//! of string literals (`"..."`), character classes (`[a-z]`, `[^"\\]`), `.` (any character),
//! rule names and groups (`( ... )`), each optionally repeated (`*`, `+`, `?`, `{m}`, `{m,}`,
//! `{m,n}`); `#` starts a comment; a rule runs until the next `name ::=`, over any number of
//! lines. The start rule is `root`.
//!
//! The translation is token by token: each rule on one Lark line (`root` becomes Lark's
//! `start`; a name Lark would not take as a rule, such as one with capitals, gets a fresh
//! one), each literal re-quoted as the JSON string llguidance's Lark reads, each class and `.`
//! a one-character regex, the operators as they are (llguidance takes GBNF's `{m,n}`).

use std::collections::HashMap;

/// Whether `src` reads as GBNF rather than Lark: some line defines a rule with `::=`.
pub fn looks_like_gbnf(src: &str) -> bool {
    src.lines().any(|line| {
        let line = line.trim_start();
        match line.find("::=") {
            Some(at) if !line.starts_with('#') => {
                let name = line[..at].trim_end();
                !name.is_empty() && name.chars().all(is_name_char)
            }
            _ => false,
        }
    })
}

/// `src` (GBNF) as a Lark grammar, or why it does not parse.
pub fn gbnf_to_lark(src: &str) -> Result<String, String> {
    let tokens = lex(src)?;
    let mut names = Names::default();
    let mut rules: Vec<(String, Vec<String>)> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let (Tok::Name(name), Some(Tok::Define)) = (&tokens[i], tokens.get(i + 1)) else {
            return Err(format!(
                "expected a rule (`name ::= ...`), found {}",
                tokens[i].describe()
            ));
        };
        i += 2;
        let lark_name = names.lark(name);
        let mut body = Vec::new();
        let mut depth = 0usize;
        while i < tokens.len() {
            if depth == 0
                && matches!(tokens[i], Tok::Name(_))
                && matches!(tokens.get(i + 1), Some(Tok::Define))
            {
                break;
            }
            let piece = match &tokens[i] {
                Tok::Name(n) => names.lark(n),
                Tok::Define => return Err("`::=` inside a rule's body".into()),
                Tok::Literal(s) => {
                    if s.is_empty() {
                        // An empty literal matches the empty string: an empty group.
                        "\"\"".to_owned()
                    } else {
                        serde_json::to_string(s).map_err(|e| e.to_string())?
                    }
                }
                Tok::Class(class) => format!("/{class}/"),
                Tok::Any => "/(?s:.)/".to_owned(),
                Tok::Open => {
                    depth += 1;
                    "(".to_owned()
                }
                Tok::Close => {
                    depth = depth
                        .checked_sub(1)
                        .ok_or("a `)` without its `(`".to_owned())?;
                    ")".to_owned()
                }
                Tok::Bar => "|".to_owned(),
                Tok::Op(c) => c.to_string(),
                Tok::Repeat(r) => r.clone(),
            };
            body.push(piece);
            i += 1;
        }
        if depth != 0 {
            return Err(format!("rule `{name}` has an unclosed `(`"));
        }
        if body.is_empty() {
            return Err(format!("rule `{name}` is empty"));
        }
        rules.push((lark_name, body));
    }
    if !rules.iter().any(|(n, _)| n == "start") {
        return Err("the grammar has no `root` rule".into());
    }
    let mut out = String::new();
    for (name, body) in rules {
        out.push_str(&name);
        out.push_str(": ");
        out.push_str(&body.join(" "));
        out.push('\n');
    }
    Ok(out)
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

/// GBNF rule names → Lark rule names, one to one.
#[derive(Debug, Default)]
struct Names {
    map: HashMap<String, String>,
}

impl Names {
    fn lark(&mut self, gbnf: &str) -> String {
        if let Some(n) = self.map.get(gbnf) {
            return n.clone();
        }
        let valid = gbnf.starts_with(|c: char| c.is_ascii_lowercase())
            && gbnf
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_');
        let name = match gbnf {
            "root" => "start".to_owned(),
            // Fresh names cannot clash with kept ones: those never start with `gbnf--`.
            _ if !valid || gbnf == "start" || gbnf.starts_with("gbnf--") => {
                format!("gbnf--{}", self.map.len())
            }
            _ => gbnf.to_owned(),
        };
        self.map.insert(gbnf.to_owned(), name.clone());
        name
    }
}

/// One GBNF token.
#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Name(String),
    Define,
    /// A string literal, unescaped.
    Literal(String),
    /// A character class as a regex class (`[...]`), escaped for Lark's `/.../`.
    Class(String),
    Any,
    Open,
    Close,
    Bar,
    Op(char),
    /// `{m}`, `{m,}` or `{m,n}`, as written.
    Repeat(String),
}

impl Tok {
    fn describe(&self) -> String {
        match self {
            Self::Name(n) => format!("`{n}`"),
            Self::Define => "`::=`".into(),
            Self::Literal(s) => format!("the literal {s:?}"),
            Self::Class(c) => format!("the class {c}"),
            Self::Any => "`.`".into(),
            Self::Open => "`(`".into(),
            Self::Close => "`)`".into(),
            Self::Bar => "`|`".into(),
            Self::Op(c) => format!("`{c}`"),
            Self::Repeat(r) => format!("`{r}`"),
        }
    }
}

fn lex(src: &str) -> Result<Vec<Tok>, String> {
    let chars: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            c if c.is_whitespace() => i += 1,
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            ':' if chars.get(i + 1..i + 3) == Some(&[':', '=']) => {
                out.push(Tok::Define);
                i += 3;
            }
            '"' => {
                let (s, next) = literal(&chars, i + 1)?;
                out.push(Tok::Literal(s));
                i = next;
            }
            '[' => {
                let (class, next) = class(&chars, i + 1)?;
                out.push(Tok::Class(class));
                i = next;
            }
            '.' => {
                out.push(Tok::Any);
                i += 1;
            }
            '(' => {
                out.push(Tok::Open);
                i += 1;
            }
            ')' => {
                out.push(Tok::Close);
                i += 1;
            }
            '|' => {
                out.push(Tok::Bar);
                i += 1;
            }
            '*' | '+' | '?' => {
                out.push(Tok::Op(c));
                i += 1;
            }
            '{' => {
                let end = (i..chars.len())
                    .find(|&j| chars[j] == '}')
                    .ok_or("a `{` without its `}`")?;
                let inner: String = chars[i + 1..end]
                    .iter()
                    .filter(|c| !c.is_whitespace())
                    .collect();
                let ok = !inner.is_empty()
                    && inner.chars().all(|c| c.is_ascii_digit() || c == ',')
                    && inner.matches(',').count() <= 1
                    && !inner.starts_with(',');
                if !ok {
                    return Err(format!("bad repetition `{{{inner}}}`"));
                }
                out.push(Tok::Repeat(format!("{{{inner}}}")));
                i = end + 1;
            }
            c if is_name_char(c) => {
                let start = i;
                while i < chars.len() && is_name_char(chars[i]) {
                    i += 1;
                }
                out.push(Tok::Name(chars[start..i].iter().collect()));
            }
            other => return Err(format!("unexpected character `{other}`")),
        }
    }
    Ok(out)
}

/// The escape at `chars[i]` (just after a `\`): the character and the index after it.
fn escape(chars: &[char], i: usize) -> Result<(char, usize), String> {
    let c = *chars.get(i).ok_or("a `\\` at the end")?;
    let hex = |n: usize| -> Result<(char, usize), String> {
        let digits: String = chars
            .get(i + 1..i + 1 + n)
            .ok_or("a short escape")?
            .iter()
            .collect();
        let code =
            u32::from_str_radix(&digits, 16).map_err(|_| format!("bad escape `\\{c}{digits}`"))?;
        let ch = char::from_u32(code).ok_or(format!("bad escape `\\{c}{digits}`"))?;
        Ok((ch, i + 1 + n))
    };
    match c {
        'n' => Ok(('\n', i + 1)),
        'r' => Ok(('\r', i + 1)),
        't' => Ok(('\t', i + 1)),
        'x' => hex(2),
        'u' => hex(4),
        'U' => hex(8),
        other => Ok((other, i + 1)),
    }
}

/// A string literal from `chars[i]` (after its opening quote): its text and the index after
/// its closing quote.
fn literal(chars: &[char], mut i: usize) -> Result<(String, usize), String> {
    let mut s = String::new();
    loop {
        match chars.get(i) {
            None => return Err("an unterminated string literal".into()),
            Some('"') => return Ok((s, i + 1)),
            Some('\\') => {
                let (c, next) = escape(chars, i + 1)?;
                s.push(c);
                i = next;
            }
            Some(&c) => {
                s.push(c);
                i += 1;
            }
        }
    }
}

/// A character class from `chars[i]` (after its `[`): as a regex class, each member written
/// so that the regex parser reads it as that character alone, and the index after its `]`.
fn class(chars: &[char], mut i: usize) -> Result<(String, usize), String> {
    let mut out = String::from("[");
    if chars.get(i) == Some(&'^') {
        out.push('^');
        i += 1;
    }
    let mut n_members = 0;
    loop {
        let (c, next) = match chars.get(i) {
            None => return Err("an unterminated character class".into()),
            Some(']') => {
                if n_members == 0 {
                    return Err("an empty character class".into());
                }
                out.push(']');
                return Ok((out, i + 1));
            }
            // A range's dash stays an operator.
            Some('-') if n_members > 0 && chars.get(i + 1) != Some(&']') => {
                out.push('-');
                i += 1;
                continue;
            }
            Some('\\') => escape(chars, i + 1)?,
            Some(&c) => (c, i + 1),
        };
        push_class_char(&mut out, c);
        n_members += 1;
        i = next;
    }
}

/// `c` inside a regex class: escaped when it is special there (or to Lark's `/.../`), as a
/// `\x{..}` when it is a control character.
fn push_class_char(out: &mut String, c: char) {
    match c {
        '\\' | ']' | '[' | '^' | '-' | '&' | '~' | '/' => {
            out.push('\\');
            out.push(c);
        }
        c if c.is_control() => out.push_str(&format!("\\x{{{:x}}}", c as u32)),
        c => out.push(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gbnf_is_told_from_lark() {
        assert!(looks_like_gbnf("root ::= \"a\""));
        assert!(looks_like_gbnf("# c\nroot   ::= x\nx ::= [a-z]"));
        assert!(!looks_like_gbnf("start: \"a\""));
        assert!(!looks_like_gbnf("# root ::= x\nstart: \"a\""));
    }

    #[test]
    fn rules_translate_token_by_token() {
        let src = r#"
            # a comment
            root ::= greeting (" " Name)* "!"{1,3}
            greeting ::= "hi" | "hello\n"
            Name ::= [A-Z] [a-z\-]+ .?
        "#;
        assert_eq!(
            gbnf_to_lark(src).unwrap(),
            "start: greeting ( \" \" gbnf--2 ) * \"!\" {1,3}\n\
             greeting: \"hi\" | \"hello\\n\"\n\
             gbnf--2: /[A-Z]/ /[a-z\\-]/ + /(?s:.)/ ?\n"
        );
        // Classes: negation, escapes, a leading or trailing dash, a slash.
        assert_eq!(
            gbnf_to_lark(r#"root ::= [^"\\] [-a/] [a-] [\x41]"#).unwrap(),
            "start: /[^\"\\\\]/ /[\\-a\\/]/ /[a\\-]/ /[A]/\n"
        );
    }

    #[test]
    fn bad_grammars_say_why() {
        assert!(gbnf_to_lark("x ::= \"a\"").unwrap_err().contains("root"));
        assert!(gbnf_to_lark("root ::= (\"a\"")
            .unwrap_err()
            .contains("unclosed"));
        assert!(gbnf_to_lark("root ::= \"a")
            .unwrap_err()
            .contains("unterminated"));
        assert!(gbnf_to_lark("root ::= []").unwrap_err().contains("empty"));
        assert!(gbnf_to_lark("root ::= ").unwrap_err().contains("empty"));
        assert!(gbnf_to_lark("root ::= a{x}")
            .unwrap_err()
            .contains("repetition"));
    }
}
