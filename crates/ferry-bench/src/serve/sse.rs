//! An incremental reader of the `data:` payloads of a server-sent-events body.
//!
//! Written by hand rather than taken from a crate: the benchmark needs only the data of each
//! event, as soon as its closing blank line arrives (the arrival time is what it measures), and
//! none of the rest of the EventSource machinery (event names, ids, retry, reconnection). The
//! one small crate for this, `eventsource-stream`, has had no release since 2022 and would
//! bring `nom` and a futures adapter for what is a line splitter.

/// Collects bytes as they arrive and hands back each complete event's data.
#[derive(Debug, Default)]
pub struct SseReader {
    /// Bytes after the last line ending seen.
    partial: Vec<u8>,
    /// `data:` lines of the event being read, joined with `\n` (as the SSE spec says).
    data: Option<String>,
}

/// A body that is not valid UTF-8 where a line ends.
#[derive(Debug, thiserror::Error)]
#[error("server-sent event line is not UTF-8")]
pub struct NotUtf8;

impl SseReader {
    /// Feeds `bytes` and returns the data of every event completed by them, in order.
    /// Lines end with `\n` or `\r\n`.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<String>, NotUtf8> {
        let mut events = Vec::new();
        let mut rest = bytes;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            self.partial.extend_from_slice(&rest[..pos]);
            rest = &rest[pos + 1..];
            let mut line = std::mem::take(&mut self.partial);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            let line = String::from_utf8(line).map_err(|_| NotUtf8)?;
            if let Some(event) = self.on_line(&line) {
                events.push(event);
            }
        }
        self.partial.extend_from_slice(rest);
        Ok(events)
    }

    fn on_line(&mut self, line: &str) -> Option<String> {
        if line.is_empty() {
            // A blank line closes the event; one without data lines dispatches nothing.
            return self.data.take();
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        // Lines starting with ':' are comments (field ""); fields other than data don't
        // matter here.
        if field == "data" {
            let value = value.strip_prefix(' ').unwrap_or(value);
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_chunks_come_out_whole_and_in_order() {
        let body = b"data: {\"a\":1}\n\n: keep-alive\n\ndata: x\r\ndata:y\r\n\r\nevent: e\ndata: [DONE]\n\n";
        for cut in 0..body.len() {
            let mut r = SseReader::default();
            let mut got = r.feed(&body[..cut]).unwrap();
            got.extend(r.feed(&body[cut..]).unwrap());
            assert_eq!(got, ["{\"a\":1}", "x\ny", "[DONE]"], "cut at {cut}");
        }
    }

    #[test]
    fn an_unfinished_event_is_held_back() {
        let mut r = SseReader::default();
        assert!(r.feed(b"data: 1\n").unwrap().is_empty());
        assert_eq!(r.feed(b"\n").unwrap(), ["1"]);
    }

    #[test]
    fn invalid_utf8_is_an_error() {
        let mut r = SseReader::default();
        assert!(r.feed(b"data: \xff\n\n").is_err());
    }
}
