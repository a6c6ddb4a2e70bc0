//! A small arithmetic evaluator: the calculator tool of the unit-conversion task.
//!
//! It reads what a model writes (`3.5 * 1.609344`, `(98.6 - 32) * 5 / 9`, `2^10`, `-4e-3`) and
//! nothing else: no names, no functions, no side effects. Input length and nesting depth are
//! bounded, so hostile input costs microseconds and cannot overflow the stack.

/// Longest expression accepted, in bytes.
pub const MAX_LENGTH: usize = 256;
/// Deepest nesting of parentheses and unary signs accepted.
pub const MAX_DEPTH: usize = 32;

/// Why an expression was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExprError {
    /// Longer than [`MAX_LENGTH`].
    #[error("expression is {0} bytes long; the limit is {MAX_LENGTH}")]
    TooLong(usize),
    /// Nested deeper than [`MAX_DEPTH`].
    #[error("expression is nested deeper than {MAX_DEPTH} levels")]
    TooDeep,
    /// Something other than a number, an operator or a parenthesis.
    #[error("unexpected {found} at byte {position}")]
    Unexpected {
        /// What was found (`'x'`, `end of input`).
        found: String,
        /// Byte offset.
        position: usize,
    },
    /// Division by zero, overflow to infinity, or another result that is not a finite number.
    #[error("the result is not a finite number")]
    NotFinite,
}

/// Evaluates an arithmetic expression: numbers, `+ - * / ^`, parentheses, unary signs.
/// `^` binds tightest and is right-associative; `-2^2` is `-4`, as in mathematics.
pub fn evaluate(text: &str) -> Result<f64, ExprError> {
    if text.len() > MAX_LENGTH {
        return Err(ExprError::TooLong(text.len()));
    }
    let mut parser = Parser {
        bytes: text.as_bytes(),
        position: 0,
        depth: 0,
    };
    let value = parser.sum()?;
    parser.skip_space();
    if parser.position < parser.bytes.len() {
        return Err(parser.unexpected());
    }
    if value.is_finite() {
        Ok(value)
    } else {
        Err(ExprError::NotFinite)
    }
}

struct Parser<'a> {
    bytes: &'a [u8],
    position: usize,
    depth: usize,
}

impl Parser<'_> {
    fn skip_space(&mut self) {
        while self
            .bytes
            .get(self.position)
            .is_some_and(u8::is_ascii_whitespace)
        {
            self.position += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_space();
        self.bytes.get(self.position).copied()
    }

    fn unexpected(&self) -> ExprError {
        let found = match self.bytes.get(self.position) {
            None => "end of input".to_owned(),
            Some(_) => {
                // Report the whole character, even when it is multi-byte UTF-8.
                let rest = String::from_utf8_lossy(&self.bytes[self.position..]);
                format!("{:?}", rest.chars().next().unwrap_or('?'))
            }
        };
        ExprError::Unexpected {
            found,
            position: self.position,
        }
    }

    fn descend(&mut self) -> Result<(), ExprError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(ExprError::TooDeep);
        }
        Ok(())
    }

    fn sum(&mut self) -> Result<f64, ExprError> {
        let mut value = self.product()?;
        while let Some(op @ (b'+' | b'-')) = self.peek() {
            self.position += 1;
            let rhs = self.product()?;
            value = if op == b'+' { value + rhs } else { value - rhs };
        }
        Ok(value)
    }

    fn product(&mut self) -> Result<f64, ExprError> {
        let mut value = self.unary()?;
        while let Some(op @ (b'*' | b'/')) = self.peek() {
            self.position += 1;
            let rhs = self.unary()?;
            value = if op == b'*' {
                value * rhs
            } else {
                if rhs == 0.0 {
                    return Err(ExprError::NotFinite);
                }
                value / rhs
            };
        }
        Ok(value)
    }

    fn unary(&mut self) -> Result<f64, ExprError> {
        match self.peek() {
            Some(sign @ (b'-' | b'+')) => {
                self.position += 1;
                self.descend()?;
                let value = self.unary()?;
                self.depth -= 1;
                Ok(if sign == b'-' { -value } else { value })
            }
            _ => self.power(),
        }
    }

    fn power(&mut self) -> Result<f64, ExprError> {
        let base = self.atom()?;
        if self.peek() == Some(b'^') {
            self.position += 1;
            self.descend()?;
            let exponent = self.unary()?;
            self.depth -= 1;
            return Ok(base.powf(exponent));
        }
        Ok(base)
    }

    fn atom(&mut self) -> Result<f64, ExprError> {
        match self.peek() {
            Some(b'(') => {
                self.position += 1;
                self.descend()?;
                let value = self.sum()?;
                self.depth -= 1;
                if self.peek() != Some(b')') {
                    return Err(self.unexpected());
                }
                self.position += 1;
                Ok(value)
            }
            Some(c) if c.is_ascii_digit() || c == b'.' => self.number(),
            _ => Err(self.unexpected()),
        }
    }

    fn number(&mut self) -> Result<f64, ExprError> {
        let start = self.position;
        let digits = |p: &mut Self| {
            while p
                .bytes
                .get(p.position)
                .is_some_and(|c| c.is_ascii_digit() || *c == b'.')
            {
                p.position += 1;
            }
        };
        digits(self);
        if let Some(b'e' | b'E') = self.bytes.get(self.position) {
            let mark = self.position;
            self.position += 1;
            if let Some(b'+' | b'-') = self.bytes.get(self.position) {
                self.position += 1;
            }
            if self
                .bytes
                .get(self.position)
                .is_some_and(u8::is_ascii_digit)
            {
                digits(self);
            } else {
                self.position = mark;
            }
        }
        let text = std::str::from_utf8(&self.bytes[start..self.position]).unwrap_or("");
        text.parse::<f64>().map_err(|_| ExprError::Unexpected {
            found: format!("{text:?}"),
            position: start,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precedence_and_associativity_follow_mathematics() {
        assert_eq!(evaluate("1 + 2 * 3").unwrap(), 7.0);
        assert_eq!(evaluate("(1 + 2) * 3").unwrap(), 9.0);
        assert_eq!(evaluate("2 ^ 3 ^ 2").unwrap(), 512.0);
        assert_eq!(evaluate("-2^2").unwrap(), -4.0);
        assert_eq!(evaluate("10 - 4 - 3").unwrap(), 3.0);
        assert_eq!(evaluate("8 / 4 / 2").unwrap(), 1.0);
        assert_eq!(evaluate(" 3.5e2 * 1e-2 ").unwrap(), 3.5);
    }

    #[test]
    fn a_fahrenheit_conversion_evaluates_exactly_as_written() {
        assert!((evaluate("(98.6 - 32) * 5 / 9").unwrap() - 37.0).abs() < 1e-12);
    }

    #[test]
    fn errors_name_what_was_found_and_where() {
        assert_eq!(
            evaluate("2 * x").unwrap_err().to_string(),
            "unexpected 'x' at byte 4"
        );
        assert_eq!(
            evaluate("(1 + 2").unwrap_err().to_string(),
            "unexpected end of input at byte 6"
        );
        assert_eq!(
            evaluate("1..2").unwrap_err().to_string(),
            "unexpected \"1..2\" at byte 0"
        );
        assert_eq!(evaluate("1 / 0"), Err(ExprError::NotFinite));
        assert_eq!(evaluate("10 ^ 400"), Err(ExprError::NotFinite));
    }

    #[test]
    fn hostile_input_is_bounded() {
        assert_eq!(evaluate(&"(".repeat(200)), Err(ExprError::TooDeep));
        assert_eq!(evaluate(&"-".repeat(200)), Err(ExprError::TooDeep));
        assert!(matches!(
            evaluate(&"1+".repeat(200)),
            Err(ExprError::TooLong(400))
        ));
        assert!(evaluate("__import__('os')").is_err());
        assert!(evaluate("2 × 3").is_err());
    }
}
