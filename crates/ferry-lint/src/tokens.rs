//! Rust source as the checker reads it: identifiers, `::`, punctuation and the text of string
//! literals (a `#[path = "..."]` names a file), each with its line. Comments, character
//! literals, lifetimes and numbers are dropped, so a path written in a comment or a string is
//! never taken for an import.

/// One token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tok {
    Ident(String),
    /// `::`
    PathSep,
    Punct(char),
    /// A string literal's text between its quotes, escapes as written.
    Str(String),
}

/// A token and the line it starts on (1-based).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub tok: Tok,
    pub line: usize,
}

/// Splits Rust source into tokens.
pub fn tokenize(src: &str) -> Vec<Token> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line = 1;
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let mut push = |tok: Tok, line: usize| out.push(Token { tok, line });
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if ch == '"' {
            let start_line = line;
            i += 1;
            let start = i;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    i += 1;
                }
                if at(i) == '\n' {
                    line += 1;
                }
                i += 1;
            }
            let text: String = c[start..i.min(c.len())].iter().collect();
            push(Tok::Str(text), start_line);
            i += 1;
        } else if ch == '\'' {
            if at(i + 1) == '\\' {
                // An escaped character literal: up to its closing quote.
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                // A lifetime or label: its name follows as an identifier, which is harmless.
                i += 1;
            }
        } else if ch == '_' || ch.is_alphabetic() {
            let start = i;
            while i < c.len() && (c[i] == '_' || c[i].is_alphanumeric()) {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let raw_prefix = matches!(word.as_str(), "r" | "br" | "cr");
            if raw_prefix && (at(i) == '"' || at(i) == '#') {
                let mut hashes = 0;
                let mut j = i;
                while at(j) == '#' {
                    hashes += 1;
                    j += 1;
                }
                if at(j) == '"' {
                    // A raw string: up to a quote followed by as many hashes.
                    let start_line = line;
                    j += 1;
                    let start = j;
                    let mut end = c.len();
                    while j < c.len() {
                        if c[j] == '"' && (1..=hashes).all(|k| at(j + k) == '#') {
                            end = j;
                            j += 1 + hashes;
                            break;
                        }
                        if c[j] == '\n' {
                            line += 1;
                        }
                        j += 1;
                    }
                    push(Tok::Str(c[start..end].iter().collect()), start_line);
                    i = j;
                    continue;
                }
                // A raw identifier (`r#type`): the identifier follows.
                i = j;
                continue;
            }
            push(Tok::Ident(word), line);
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i] == '_' || c[i].is_alphanumeric()) {
                i += 1;
            }
        } else if ch == ':' && at(i + 1) == ':' {
            push(Tok::PathSep, line);
            i += 2;
        } else {
            push(Tok::Punct(ch), line);
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(src: &str) -> Vec<Tok> {
        tokenize(src).into_iter().map(|t| t.tok).collect()
    }

    fn ident(s: &str) -> Tok {
        Tok::Ident(s.to_owned())
    }

    #[test]
    fn comments_characters_and_lifetimes_are_dropped_and_strings_kept_as_text() {
        let src =
            "// crate::a\n/* crate::b /* nested */ */ x::<'a>('\\'', '\"', r#\"q\"#, \"s\\\"t\")";
        assert_eq!(
            toks(src),
            vec![
                ident("x"),
                Tok::PathSep,
                Tok::Punct('<'),
                ident("a"),
                Tok::Punct('>'),
                Tok::Punct('('),
                Tok::Punct(','),
                Tok::Punct(','),
                Tok::Str("q".into()),
                Tok::Punct(','),
                Tok::Str("s\\\"t".into()),
                Tok::Punct(')'),
            ]
        );
        let lines: Vec<usize> = tokenize("a\n\"x\ny\"\nb").iter().map(|t| t.line).collect();
        assert_eq!(lines, vec![1, 2, 4]);
    }
}
