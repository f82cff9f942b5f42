//! Field types shared by the config sections: verl's "string or list" keys and its
//! "-1 means unset" integers.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A key verl accepts either as one string or as a list of strings
/// (`data.train_files`, `trainer.logger`: `logger=console` and `logger=['console']` both work).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    /// The values as a list, in order.
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

impl Default for OneOrMany {
    fn default() -> Self {
        OneOrMany::Many(Vec::new())
    }
}

/// Serde adapter for verl integers where `null`, `-1` (any value <= 0) means "unset".
/// Unset is written back as `-1`, verl's spelling.
pub mod nonpositive_none {
    use super::*;

    pub fn serialize<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(n) => s.serialize_u64(*n),
            None => s.serialize_i64(-1),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        let v: Option<i64> = Option::deserialize(d)?;
        Ok(v.and_then(|n| if n > 0 { Some(n as u64) } else { None }))
    }
}

/// Serde adapter for integers where `null` or a negative value means "unset" but 0 is a
/// value (written back as `null`).
pub mod negative_none {
    use super::*;

    pub fn serialize<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(n) => s.serialize_u64(*n),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        let v: Option<i64> = Option::deserialize(d)?;
        Ok(v.and_then(|n| if n >= 0 { Some(n as u64) } else { None }))
    }
}

/// Serde adapter for verl integers where a negative value (or `null`) means "unset" and 0 is
/// a value (`optim.lr_warmup_steps`: 0 = no warm-up, -1 = use the ratio). Unset is written
/// back as `-1`, verl's spelling.
pub mod negative_unset {
    use super::*;

    /// Written back as verl spells unset: `-1`.
    pub use super::nonpositive_none::serialize;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        let v: Option<i64> = Option::deserialize(d)?;
        Ok(v.and_then(|n| if n >= 0 { Some(n as u64) } else { None }))
    }
}

/// A free-form mapping passed through to user code (`reward_kwargs`,
/// `apply_chat_template_kwargs`, ...). Any keys are accepted.
pub type FreeMap = serde_json::Map<String, serde_json::Value>;

/// Generates `Default` from a list of `field: value` pairs, so each section states its
/// defaults once, next to the struct.
#[macro_export]
macro_rules! defaults {
    ($ty:ty { $($field:ident : $value:expr),* $(,)? }) => {
        impl Default for $ty {
            fn default() -> Self {
                Self { $($field: $value),* }
            }
        }
    };
}

/// Serde adapter for a section verl writes as `null` when empty (`override_optimizer_config:
/// null`): `null` reads as the section's default.
pub mod null_default {
    use serde::{Deserialize, Deserializer};

    pub fn deserialize<'de, D, T>(d: D) -> Result<T, D::Error>
    where
        D: Deserializer<'de>,
        T: Deserialize<'de> + Default,
    {
        Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
    }
}
