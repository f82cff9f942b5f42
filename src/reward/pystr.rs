//! Python `str` semantics the rule scorers depend on: slicing by code points, `str.isspace`,
//! `str.split()`, `str.strip()`, `str.isdigit()`.

/// `s[-n:]`: the last `n` code points.
pub fn last_chars(s: &str, n: usize) -> &str {
    let count = s.chars().count();
    if count <= n {
        return s;
    }
    let skip = count - n;
    let (i, _) = s.char_indices().nth(skip).expect("skip < count");
    &s[i..]
}

/// `c.isspace()`: Unicode White_Space plus the ASCII separators U+001C..U+001F, which CPython
/// also counts as whitespace.
pub fn is_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `s.split()`: runs of whitespace separate, no empty parts.
pub fn split_ws(s: &str) -> Vec<&str> {
    s.split(is_space).filter(|p| !p.is_empty()).collect()
}

/// `s.strip()`.
pub fn strip(s: &str) -> &str {
    s.trim_matches(is_space)
}

/// `c.isdigit()`: decimal digits (Unicode category Nd) and the other characters with
/// Numeric_Type=Digit (superscripts, subscripts, circled and parenthesised digits, ...).
pub fn is_digit_char(c: char) -> bool {
    if c.is_ascii_digit() {
        return true;
    }
    if !c.is_numeric() {
        return false;
    }
    is_decimal(c)
        || DIGIT_TYPE
            .iter()
            .any(|&(lo, hi)| (lo..=hi).contains(&(c as u32)))
}

/// `s.isdigit()`: non-empty and every character a digit.
pub fn is_digit(s: &str) -> bool {
    !s.is_empty() && s.chars().all(is_digit_char)
}

/// Unicode Nd: runs of ten consecutive code points whose first is a digit zero. Every Nd block
/// in Unicode is such a run, so a numeric character is Nd when its offset within the run
/// (found from the zero) makes it one.
fn is_decimal(c: char) -> bool {
    let cp = c as u32;
    (0..10).any(|k| cp >= k && char::from_u32(cp - k).is_some_and(|z| ZEROS.contains(&(z as u32))))
}

/// Code points of the digit zero of each Nd run (Unicode 15).
const ZEROS: &[u32] = &[
    0x30, 0x660, 0x6F0, 0x7C0, 0x966, 0x9E6, 0xA66, 0xAE6, 0xB66, 0xBE6, 0xC66, 0xCE6, 0xD66,
    0xDE6, 0xE50, 0xED0, 0xF20, 0x1040, 0x1090, 0x17E0, 0x1810, 0x1946, 0x19D0, 0x1A80, 0x1A90,
    0x1B50, 0x1BB0, 0x1C40, 0x1C50, 0xA620, 0xA8D0, 0xA900, 0xA9D0, 0xA9F0, 0xAA50, 0xABF0, 0xFF10,
    0x104A0, 0x10D30, 0x11066, 0x110F0, 0x11136, 0x111D0, 0x112F0, 0x11450, 0x114D0, 0x11650,
    0x116C0, 0x11730, 0x118E0, 0x11950, 0x11C50, 0x11D50, 0x11DA0, 0x11F50, 0x16A60, 0x16AC0,
    0x16B50, 0x1D7CE, 0x1D7D8, 0x1D7E2, 0x1D7EC, 0x1D7F6, 0x1E140, 0x1E2F0, 0x1E4F0, 0x1E950,
    0x1FBF0,
];

/// Ranges of Numeric_Type=Digit characters outside Nd (Unicode 15 UnicodeData field 7).
const DIGIT_TYPE: &[(u32, u32)] = &[
    (0xB2, 0xB3),
    (0xB9, 0xB9),
    (0x1369, 0x1371),
    (0x19DA, 0x19DA),
    (0x2070, 0x2070),
    (0x2074, 0x2079),
    (0x2080, 0x2089),
    (0x2460, 0x2468),
    (0x2474, 0x247C),
    (0x2488, 0x2490),
    (0x24EA, 0x24EA),
    (0x24F5, 0x24FD),
    (0x24FF, 0x24FF),
    (0x2776, 0x277E),
    (0x2780, 0x2788),
    (0x278A, 0x2792),
    (0x10A40, 0x10A43),
    (0x10E60, 0x10E68),
    (0x11052, 0x1105A),
    (0x1F100, 0x1F10A),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_semantics() {
        // Each expectation is what CPython 3.11 returns for the same call.
        assert_eq!(last_chars("héllo", 3), "llo");
        assert_eq!(last_chars("日本語テキスト", 2), "スト");
        assert_eq!(last_chars("ab", 5), "ab");
        assert!(
            is_digit("123") && is_digit("²") && is_digit("٣") && is_digit("①") && is_digit("１２")
        );
        assert!(
            !is_digit("½")
                && !is_digit("")
                && !is_digit("1.5")
                && !is_digit("Ⅳ")
                && !is_digit("-1")
        );
        assert_eq!(split_ws(" a\u{1f}b\u{a0}c\n"), vec!["a", "b", "c"]);
        assert_eq!(strip("\u{3000} x \u{1c}"), "x");
    }
}
