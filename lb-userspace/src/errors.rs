//! Errors as people read them: the error and its causes on one line, each
//! said once.

use std::error::Error;

/// `error: cause: cause`. A cause whose text the line already ends with is
/// left out, so that an error that both shows and returns its source (as
/// some libraries' do) is not printed twice.
pub fn chain(error: &(dyn Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut cause = error.source();
    while let Some(current) = cause {
        let text = current.to_string();
        if !text.is_empty() && !line.ends_with(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = current.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read /etc/x: {0}")]
    struct Repeats(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read /etc/x")]
    struct Plain(#[source] std::io::Error);

    fn is_a_directory() -> std::io::Error {
        std::io::Error::from_raw_os_error(libc::EISDIR)
    }

    #[test]
    fn each_cause_is_said_once() {
        let expected = format!("cannot read /etc/x: {}", is_a_directory());
        assert_eq!(chain(&Repeats(is_a_directory())), expected);
        assert_eq!(chain(&Plain(is_a_directory())), expected);
    }
}
