//! How deeply a YAML document nests, found in one pass before the YAML parser sees it.
//!
//! The parser under serde_yaml_ng (libyaml, translated to Rust) keeps one "simple key" slot per
//! open flow collection (`[` or `{`) and walks every slot for every token it reads, so a document
//! of nested flow collections costs time quadratic in its length: 200 KB of `[[[...]]]` takes a
//! minute. serde_yaml_ng's own recursion limit acts only once the whole document has been read
//! into events, which is where the minute goes.
//!
//! Counting brackets is not enough: a bracket inside a quoted, plain or block scalar or a comment
//! does not nest, and, worse, a quote the count takes for an opening one could hide the brackets
//! that do. So this scanner follows libyaml's tokenizer wherever it decides where a token starts
//! and ends: comments, quoted scalars and their escapes, plain scalars (which run on over lines
//! indented deeper than their block), block scalars (whose extent depends on the block
//! indentation), anchors, tags and directives, and the stack of block indentations that those
//! depend on. It builds nothing and reads each byte a bounded number of times. Where the document
//! is malformed the parser stops at its first error and reads nothing after it, so what the scan
//! concludes past that point does not matter.

/// Where a document first nests deeper than the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TooDeep {
    /// Line of the token that went one level too deep, from 1.
    pub line: usize,
}

/// Checks that `text` never nests more than `limit` levels deep, counting open flow collections
/// and open block collections (block mappings and sequences) together.
pub(crate) fn check(text: &str, limit: usize) -> Result<(), TooDeep> {
    Scanner::new(text.as_bytes(), limit).run()
}

/// A position, as libyaml's marks give it: `index` in bytes, `column` in characters.
#[derive(Debug, Clone, Copy)]
struct Mark {
    index: usize,
    line: usize,
    column: usize,
}

/// The characters libyaml's scanner reads in a tag besides letters, digits, `_` and `-`
/// (`,`, `[` and `]` only in a verbatim tag `!<...>`).
const TAG_PUNCTUATION: &[u8] = b";/?:@&=+$.%!~*'()";

/// A simple key stays possible for this many bytes (and never past its line), as in libyaml.
const SIMPLE_KEY_REACH: usize = 1024;

struct Scanner<'a> {
    text: &'a [u8],
    limit: usize,
    pos: usize,
    line: usize,
    column: usize,
    /// Open flow collections.
    flow: usize,
    /// Column of the innermost open block collection, -1 outside any.
    indent: isize,
    /// The columns of the enclosing block collections (libyaml's indentation stack).
    indents: Vec<isize>,
    /// Whether a simple key (a scalar or collection followed by `:`) may start here.
    key_allowed: bool,
    /// The possible simple key of block context: where the block mapping starts if a `:` comes.
    block_key: Option<Mark>,
}

impl<'a> Scanner<'a> {
    fn new(text: &'a [u8], limit: usize) -> Self {
        Scanner {
            text,
            limit,
            pos: 0,
            line: 0,
            column: 0,
            flow: 0,
            indent: -1,
            indents: Vec::new(),
            key_allowed: true,
            block_key: None,
        }
    }

    fn rest(&self) -> &[u8] {
        self.text.get(self.pos..).unwrap_or_default()
    }

    fn at(&self, offset: usize) -> Option<u8> {
        self.text.get(self.pos + offset).copied()
    }

    fn is(&self, offset: usize, byte: u8) -> bool {
        self.at(offset) == Some(byte)
    }

    fn is_blank(&self, offset: usize) -> bool {
        matches!(self.at(offset), Some(b' ' | b'\t'))
    }

    /// A line break: `\r`, `\n`, or NEL, LINE SEPARATOR or PARAGRAPH SEPARATOR in UTF-8.
    fn is_break(&self, offset: usize) -> bool {
        match self.at(offset) {
            Some(b'\r' | b'\n') => true,
            Some(0xC2) => self.is(offset + 1, 0x85),
            Some(0xE2) => {
                self.is(offset + 1, 0x80) && matches!(self.at(offset + 2), Some(0xA8 | 0xA9))
            }
            _ => false,
        }
    }

    fn is_end(&self, offset: usize) -> bool {
        self.pos + offset >= self.text.len()
    }

    fn is_breakz(&self, offset: usize) -> bool {
        self.is_break(offset) || self.is_end(offset)
    }

    fn is_blankz(&self, offset: usize) -> bool {
        self.is_blank(offset) || self.is_breakz(offset)
    }

    /// `---` or `...` at the start of a line, followed by a blank or the end.
    fn at_document_indicator(&self) -> bool {
        self.column == 0
            && (self.rest().starts_with(b"---") || self.rest().starts_with(b"..."))
            && self.is_blankz(3)
    }

    fn mark(&self) -> Mark {
        Mark {
            index: self.pos,
            line: self.line,
            column: self.column,
        }
    }

    /// Steps over one character that is not a line break.
    fn skip(&mut self) {
        let width = match self.at(0) {
            None => return,
            Some(b) if b < 0x80 => 1,
            Some(b) if b >= 0xF0 => 4,
            Some(b) if b >= 0xE0 => 3,
            Some(_) => 2,
        };
        self.pos = (self.pos + width).min(self.text.len());
        self.column += 1;
    }

    /// Steps over one line break (`\r\n` counts as one).
    fn skip_line(&mut self) {
        if self.is(0, b'\r') && self.is(1, b'\n') {
            self.pos += 2;
        } else if self.is_break(0) {
            self.skip();
        } else {
            return;
        }
        self.line += 1;
        self.column = 0;
    }

    fn skip_to_line_end(&mut self) {
        while !self.is_breakz(0) {
            self.skip();
        }
    }

    fn depth(&self) -> usize {
        self.flow + self.indents.len()
    }

    fn deeper(&self) -> Result<(), TooDeep> {
        if self.depth() > self.limit {
            Err(TooDeep {
                line: self.line + 1,
            })
        } else {
            Ok(())
        }
    }

    /// Opens a block collection at `column` if it is indented deeper than the current one.
    fn roll_indent(&mut self, column: usize) -> Result<(), TooDeep> {
        let column = isize::try_from(column).unwrap_or(isize::MAX);
        if self.flow == 0 && self.indent < column {
            self.indents.push(self.indent);
            self.indent = column;
            self.deeper()?;
        }
        Ok(())
    }

    /// Closes the block collections indented deeper than `column`.
    fn unroll_indent(&mut self, column: isize) {
        if self.flow != 0 {
            return;
        }
        while self.indent > column {
            self.indent = self.indents.pop().unwrap_or(-1);
        }
    }

    fn save_key(&mut self) {
        if self.flow == 0 && self.key_allowed {
            self.block_key = Some(self.mark());
        }
    }

    fn remove_key(&mut self) {
        if self.flow == 0 {
            self.block_key = None;
        }
    }

    /// The column of the block context's simple key, if it is still possible here.
    fn take_possible_key(&mut self) -> Option<usize> {
        let key = self.block_key.take()?;
        (key.line == self.line && key.index + SIMPLE_KEY_REACH >= self.pos).then_some(key.column)
    }

    fn run(mut self) -> Result<(), TooDeep> {
        loop {
            self.skip_to_next_token();
            if self.is_end(0) {
                return Ok(());
            }
            self.unroll_indent(isize::try_from(self.column).unwrap_or(isize::MAX));
            self.next_token()?;
        }
    }

    /// Skips blanks, comments and line breaks, as libyaml does between tokens.
    fn skip_to_next_token(&mut self) {
        loop {
            if self.column == 0 && self.rest().starts_with("\u{feff}".as_bytes()) {
                self.skip();
            }
            // libyaml refuses a tab where a block key may start; skipping it is as good, since
            // nothing after a parse error is read.
            while self.is_blank(0) {
                self.skip();
            }
            if self.is(0, b'#') {
                self.skip_to_line_end();
            }
            if !self.is_break(0) {
                return;
            }
            self.skip_line();
            if self.flow == 0 {
                self.key_allowed = true;
            }
        }
    }

    fn next_token(&mut self) -> Result<(), TooDeep> {
        let Some(c) = self.at(0) else {
            return Ok(());
        };
        if self.column == 0 && c == b'%' {
            // A directive takes its whole line.
            self.unroll_indent(-1);
            self.remove_key();
            self.key_allowed = false;
            self.skip_to_line_end();
            self.skip_line();
            return Ok(());
        }
        if self.at_document_indicator() {
            self.unroll_indent(-1);
            self.remove_key();
            self.key_allowed = false;
            for _ in 0..3 {
                self.skip();
            }
            return Ok(());
        }
        match c {
            b'[' | b'{' => {
                self.save_key();
                self.flow += 1;
                self.deeper()?;
                self.key_allowed = true;
                self.skip();
            }
            b']' | b'}' => {
                self.remove_key();
                self.flow = self.flow.saturating_sub(1);
                self.key_allowed = false;
                self.skip();
            }
            b',' => {
                self.remove_key();
                self.key_allowed = true;
                self.skip();
            }
            b'-' if self.is_blankz(1) => {
                self.roll_indent(self.column)?;
                self.remove_key();
                self.key_allowed = true;
                self.skip();
            }
            b'?' if self.flow != 0 || self.is_blankz(1) => {
                self.roll_indent(self.column)?;
                self.remove_key();
                self.key_allowed = self.flow == 0;
                self.skip();
            }
            b':' if self.flow != 0 || self.is_blankz(1) => {
                if self.flow == 0 {
                    match self.take_possible_key() {
                        Some(key_column) => {
                            self.roll_indent(key_column)?;
                            self.key_allowed = false;
                        }
                        None => {
                            self.roll_indent(self.column)?;
                            self.key_allowed = true;
                        }
                    }
                } else {
                    self.key_allowed = false;
                }
                self.skip();
            }
            b'*' | b'&' => {
                self.save_key();
                self.key_allowed = false;
                self.skip();
                while matches!(self.at(0), Some(b) if b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
                {
                    self.skip();
                }
            }
            b'!' => {
                self.save_key();
                self.key_allowed = false;
                self.scan_tag();
            }
            b'|' | b'>' if self.flow == 0 => {
                self.remove_key();
                self.key_allowed = true;
                self.scan_block_scalar();
            }
            b'\'' | b'"' => {
                self.save_key();
                self.key_allowed = false;
                self.scan_quoted_scalar(c);
            }
            _ if self.starts_plain_scalar(c) => {
                self.save_key();
                self.key_allowed = false;
                self.scan_plain_scalar();
            }
            // A character that starts no token: the parser stops here.
            _ => self.skip(),
        }
        Ok(())
    }

    fn starts_plain_scalar(&self, c: u8) -> bool {
        let indicator = self.is_blankz(0) || b"-?:,[]{}#&*!|>'\"%@`".contains(&c);
        !indicator
            || (c == b'-' && !self.is_blank(1))
            || (self.flow == 0 && (c == b'?' || c == b':') && !self.is_blankz(1))
    }

    fn scan_tag(&mut self) {
        self.skip();
        let verbatim = self.is(0, b'<');
        if verbatim {
            self.skip();
        }
        while let Some(b) = self.at(0) {
            let tag_char = b.is_ascii_alphanumeric()
                || b == b'_'
                || b == b'-'
                || TAG_PUNCTUATION.contains(&b)
                || (verbatim && matches!(b, b',' | b'[' | b']'));
            if !tag_char {
                break;
            }
            self.skip();
        }
        if verbatim && self.is(0, b'>') {
            self.skip();
        }
    }

    /// A `'...'` or `"..."` scalar, over as many lines as it takes.
    fn scan_quoted_scalar(&mut self, quote: u8) {
        let single = quote == b'\'';
        self.skip();
        loop {
            if self.at_document_indicator() || self.is_end(0) {
                // The parser stops with an error here.
                return;
            }
            while !self.is_blankz(0) {
                if single && self.is(0, b'\'') && self.is(1, b'\'') {
                    self.skip();
                    self.skip();
                } else if self.is(0, quote) {
                    break;
                } else if !single && self.is(0, b'\\') && self.is_break(1) {
                    self.skip();
                    self.skip_line();
                    break;
                } else if !single && self.is(0, b'\\') {
                    self.skip();
                    self.skip();
                } else {
                    self.skip();
                }
            }
            if self.is(0, quote) {
                self.skip();
                return;
            }
            while self.is_blank(0) || self.is_break(0) {
                if self.is_blank(0) {
                    self.skip();
                } else {
                    self.skip_line();
                }
            }
        }
    }

    /// A plain scalar: it ends at `: `, ` #`, a flow indicator inside a flow collection, or a
    /// line indented no deeper than its block collection; quotes and brackets inside it are text.
    fn scan_plain_scalar(&mut self) {
        let indent = self.indent + 1;
        let mut leading_blanks = false;
        loop {
            if self.at_document_indicator() || self.is(0, b'#') {
                break;
            }
            while !self.is_blankz(0) {
                let c = self.at(0);
                let value_indicator = c == Some(b':') && self.is_blankz(1);
                let flow_indicator =
                    self.flow != 0 && matches!(c, Some(b',' | b'[' | b']' | b'{' | b'}'));
                if value_indicator || flow_indicator {
                    break;
                }
                // libyaml stops with an error at a `:` followed by a flow indicator inside a
                // flow collection; reading on is as good, since nothing after it is parsed.
                self.skip();
            }
            if !(self.is_blank(0) || self.is_break(0)) {
                break;
            }
            while self.is_blank(0) || self.is_break(0) {
                if self.is_blank(0) {
                    self.skip();
                } else {
                    self.skip_line();
                    leading_blanks = true;
                }
            }
            if self.flow == 0 && (self.column as isize) < indent {
                break;
            }
        }
        if leading_blanks {
            self.key_allowed = true;
        }
    }

    /// A `|` or `>` scalar: its header line, then every line indented at least as deep as its
    /// first non-empty one (or than its explicit indentation indicator).
    fn scan_block_scalar(&mut self) {
        self.skip();
        let mut increment = 0;
        if matches!(self.at(0), Some(b'+' | b'-')) {
            self.skip();
            if let Some(digit @ b'1'..=b'9') = self.at(0) {
                increment = isize::from(digit - b'0');
                self.skip();
            }
        } else if let Some(digit @ b'1'..=b'9') = self.at(0) {
            increment = isize::from(digit - b'0');
            self.skip();
            if matches!(self.at(0), Some(b'+' | b'-')) {
                self.skip();
            }
        }
        while self.is_blank(0) {
            self.skip();
        }
        if self.is(0, b'#') {
            self.skip_to_line_end();
        }
        if !self.is_breakz(0) {
            // The parser stops with an error here.
            return;
        }
        self.skip_line();
        let mut indent = 0;
        if increment != 0 {
            indent = if self.indent >= 0 {
                self.indent + increment
            } else {
                increment
            };
        }
        if !self.block_scalar_breaks(&mut indent) {
            return;
        }
        while self.column as isize == indent && !self.is_end(0) {
            self.skip_to_line_end();
            self.skip_line();
            if !self.block_scalar_breaks(&mut indent) {
                return;
            }
        }
    }

    /// Skips the indentation and the empty lines of a block scalar, settling its indentation
    /// from the first non-empty line if it is not known yet; false where the parser would stop
    /// with an error (a tab in the indentation).
    fn block_scalar_breaks(&mut self, indent: &mut isize) -> bool {
        let mut max_indent = 0;
        loop {
            while (*indent == 0 || (self.column as isize) < *indent) && self.is(0, b' ') {
                self.skip();
            }
            max_indent = max_indent.max(self.column as isize);
            if (*indent == 0 || (self.column as isize) < *indent) && self.is(0, b'\t') {
                return false;
            }
            if !self.is_break(0) {
                break;
            }
            self.skip_line();
        }
        if *indent == 0 {
            *indent = max_indent.max(self.indent + 1).max(1);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deepest(text: &str) -> usize {
        (0..200)
            .find(|&limit| check(text, limit).is_ok())
            .unwrap_or(usize::MAX)
    }

    #[test]
    fn flow_and_block_collections_both_count() {
        assert_eq!(deepest("a: 1\n"), 1);
        assert_eq!(deepest("a: [1, [2, {b: 3}]]\n"), 4);
        assert_eq!(deepest("a:\n  b:\n    - c: 1\n"), 4);
    }

    #[test]
    fn brackets_in_scalars_and_comments_do_not_count() {
        let text = "a: '[[[[' # [[[[\nb: \"[[\\\"[[\"\nc: x [[[[ y\nd: |\n  [[[[ it's\n  {{{{\ne: [\"]]]]\", ']]]]']\n";
        assert_eq!(deepest(text), 2);
    }

    #[test]
    fn a_quote_inside_a_plain_scalar_hides_nothing() {
        // The plain scalar runs on over the indented second line, so the quote there is text and
        // the brackets after it nest.
        let text = format!("a: x\n  'y\nb: {}{}\n", "[".repeat(100), "]".repeat(100));
        assert_eq!(check(&text, 64), Err(TooDeep { line: 3 }));
    }

    #[test]
    fn a_quote_inside_a_block_scalar_hides_nothing() {
        let text = format!("a: |\n  it's\nb: {}{}\n", "[".repeat(100), "]".repeat(100));
        assert_eq!(check(&text, 64), Err(TooDeep { line: 3 }));
    }

    #[test]
    fn a_quoted_closing_bracket_does_not_close() {
        let text = format!("a: {}\n", "[']',".repeat(100));
        assert_eq!(check(&text, 64), Err(TooDeep { line: 1 }));
    }

    proptest::proptest! {
        #[test]
        fn any_text_is_scanned_to_its_end_without_panicking(
            text in "[\\[\\]{}'\"#:,?|>&*!%@`\\\\ \t\r\n\u{85}\u{2028}\u{feff}a-c0-9.-]{0,300}"
        ) {
            let _ = check(&text, 64);
        }
    }

    #[test]
    fn arbitrary_bytes_of_any_shape_are_scanned_to_the_end() {
        for text in [
            "",
            "\u{feff}",
            "|",
            "|9-",
            "'",
            "\"\\",
            "!<",
            "&",
            "\r\n\r",
            "\u{2028}[",
            "]]]]",
        ] {
            let _ = check(text, 64);
        }
    }
}
