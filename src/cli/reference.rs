//! `main_ppo config reference`: the configuration reference page of the book
//! (`docs/src/reference/config.md`), written from the key catalogue (`config::catalogue`), so
//! the page is the schema. A test checks that the committed page equals this output.

use std::fmt::Write as _;

use crate::config::catalogue::{catalogue, section_description, KeyDoc, Status};

/// The top-level sections of the typed configuration, in `Config`'s order; other top-level
/// keys (verl's runtime sections, legacy reward keys) follow under one heading.
const SECTIONS: [&str; 7] = [
    "data",
    "actor_rollout_ref",
    "critic",
    "reward",
    "algorithm",
    "distillation",
    "trainer",
];

/// The heading of the top-level keys outside [`SECTIONS`].
const OTHER: &str = "Other top-level keys";

/// The whole page, as Markdown.
pub fn page() -> String {
    let docs = catalogue();
    let mut out = String::new();
    header(&mut out, &docs);
    for section in SECTIONS {
        let rows: Vec<&KeyDoc> = docs.iter().filter(|d| top(&d.key) == section).collect();
        let _ = writeln!(out, "\n## {section}\n");
        if let Some(d) = section_description(section) {
            let _ = writeln!(out, "{d}\n");
        }
        table(&mut out, &rows);
    }
    let rest: Vec<&KeyDoc> = docs
        .iter()
        .filter(|d| !SECTIONS.contains(&top(&d.key)))
        .collect();
    let _ = writeln!(
        out,
        "\n## {OTHER}\n\nverl's runtime sections and its legacy top-level reward keys.\n"
    );
    table(&mut out, &rest);
    out
}

fn top(key: &str) -> &str {
    key.split('.').next().unwrap_or(key)
}

fn header(out: &mut String, docs: &[KeyDoc]) {
    let count = |f: fn(&Status) -> bool| docs.iter().filter(|d| f(&d.status)).count();
    let _ = write!(
        out,
        "# Configuration reference\n\n\
         <!-- Written by `main_ppo config reference > docs/src/reference/config.md`; do not edit by hand. \
         The test `docs::reference_page_is_current` fails when this page differs from the binary's output. -->\n\n\
         Every key main_ppo knows: {} keys. {} are implemented, {} are accepted and not read (as in verl), \
         {} have no effect here, {} are refused unless they hold verl's default, and {} are legacy spellings \
         read at their new place. The keys and defaults are verl's unless the meaning says otherwise; \
         what the statuses mean, and why keys are refused, is in \
         [Coming from verl](../from-verl.md#what-is-refused-and-why).\n\n\
         - **type**: the values the key takes, as the configuration's typed reading accepts them.\n\
         - **default**: main_ppo's default (also in `configs/ppo_trainer.yaml`); for a refused key, the one value accepted.\n\
         - **status**: `implemented`; `accepted, not read`; `no effect` (accepted with any value, the key and every \
         key below it, and reported once); `refused unless default` (any other value stops the run at start-up, naming \
         the key and why); `legacy spelling` (read at the key the meaning names).\n\
         - Entries of `distillation.teacher_models` other than `teacher_model` \
         (`+distillation.teacher_models.<name>.model_path=...`) take `teacher_model`'s keys.\n",
        docs.len(),
        count(|s| *s == Status::Implemented),
        count(|s| *s == Status::NotRead),
        count(|s| *s == Status::NoEffect),
        count(|s| matches!(s, Status::RefusedUnlessDefault { .. })),
        count(|s| matches!(s, Status::Moved { .. })),
    );
}

fn table(out: &mut String, rows: &[&KeyDoc]) {
    out.push_str("| key | type | default | status | meaning |\n|---|---|---|---|---|\n");
    for d in rows {
        let default = d
            .default
            .as_deref()
            .map(|v| cell(&format!("`{v}`")))
            .unwrap_or_else(|| "—".into());
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} | {} |",
            d.key,
            cell(&d.kind),
            default,
            d.status.label(),
            cell(&d.meaning)
        );
    }
}

/// Text made safe for one table cell: pipes escaped, line breaks joined, and `<` outside code
/// spans written as `&lt;` (`Bearer <token>` is text, not an HTML tag).
fn cell(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut in_code = false;
    for c in s.chars() {
        match c {
            '`' => {
                in_code = !in_code;
                out.push(c);
            }
            '|' => out.push_str("\\|"),
            '\n' => out.push(' '),
            '<' if !in_code => out.push_str("&lt;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_has_one_row_per_key_and_every_section() {
        let page = page();
        let rows = page.lines().filter(|l| l.starts_with("| `")).count();
        assert_eq!(rows, catalogue().len());
        for s in SECTIONS {
            assert!(page.contains(&format!("\n## {s}\n")), "no section {s}");
        }
        // A description holding a pipe stays in its cell.
        let truncation = page
            .lines()
            .find(|l| l.starts_with("| `data.truncation` |"))
            .expect("data.truncation's row");
        assert_eq!(truncation.matches(" | ").count(), 4, "{truncation}");
        assert_eq!(cell("Bearer <token>, `a<b`"), "Bearer &lt;token>, `a<b`");
    }
}
