//! Server-sent events, as far as the OpenAI streaming API uses them: events separated by a
//! blank line, `data:` lines carrying the payload, `[DONE]` ending the stream.

/// Largest single event accepted; real completion chunks are a few hundred bytes.
pub const MAX_EVENT_BYTES: usize = 1 << 20;

/// Splits a byte stream into the `data` payloads of its events.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buffer: Vec<u8>,
    /// Bytes of `buffer` already searched for a separator, so a long event is scanned once.
    scanned: usize,
}

/// Why a byte stream is not valid server-sent events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// An event grew past [`MAX_EVENT_BYTES`] without ending.
    #[error("an event is longer than {MAX_EVENT_BYTES} bytes")]
    TooLong,
    /// An event's data is not UTF-8.
    #[error("an event is not UTF-8")]
    NotUtf8,
}

impl SseDecoder {
    /// Feeds bytes; returns the data of every event completed by them.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<String>, SseError> {
        self.buffer.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some((end, separator)) = find_event_end(&self.buffer, self.scanned) {
            let raw: Vec<u8> = self.buffer.drain(..end + separator).collect();
            self.scanned = 0;
            let text = std::str::from_utf8(&raw[..end]).map_err(|_| SseError::NotUtf8)?;
            let data: Vec<&str> = text
                .lines()
                .filter_map(|line| line.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                events.push(data.join("\n"));
            }
        }
        // A separator is at most 4 bytes, so one may straddle the end of what was searched.
        self.scanned = self.buffer.len().saturating_sub(3);
        if self.buffer.len() > MAX_EVENT_BYTES {
            return Err(SseError::TooLong);
        }
        Ok(events)
    }
}

fn find_event_end(buffer: &[u8], from: usize) -> Option<(usize, usize)> {
    let tail = &buffer[from.min(buffer.len())..];
    let lf = tail
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|i| (from + i, 2));
    let crlf = tail
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (from + i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_reads_are_reassembled() {
        let mut decoder = SseDecoder::default();
        assert!(decoder.feed(b"data: {\"a\"").unwrap().is_empty());
        assert_eq!(
            decoder.feed(b":1}\n\ndata: [DONE]\n\n").unwrap(),
            ["{\"a\":1}", "[DONE]"]
        );
    }

    #[test]
    fn crlf_separators_and_comments_are_understood() {
        let mut decoder = SseDecoder::default();
        let events = decoder
            .feed(b": keep-alive\r\n\r\ndata: x\r\n\r\n")
            .unwrap();
        assert_eq!(events, ["x"]);
    }

    #[test]
    fn a_separator_split_between_reads_is_found() {
        let mut decoder = SseDecoder::default();
        assert!(decoder.feed(b"data: a\r\n").unwrap().is_empty());
        assert!(decoder.feed(b"\r").unwrap().is_empty());
        assert_eq!(decoder.feed(b"\ndata: b\n").unwrap(), ["a"]);
        assert_eq!(decoder.feed(b"\n").unwrap(), ["b"]);
    }

    #[test]
    fn an_endless_event_is_refused() {
        let mut decoder = SseDecoder::default();
        let chunk = vec![b'x'; 64 * 1024];
        let mut result = Ok(vec![]);
        for _ in 0..20 {
            result = decoder.feed(&chunk);
            if result.is_err() {
                break;
            }
        }
        assert_eq!(result, Err(SseError::TooLong));
    }
}
