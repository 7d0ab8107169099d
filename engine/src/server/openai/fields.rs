//! The field names a request struct accepts, read from its own `Deserialize` impl, so the
//! list that refuses unknown fields can never drift from the struct.

use serde::de::{self, Deserialize, Deserializer, Visitor};

/// The fields `T` deserializes from (the struct's own names, renames applied).
pub fn fields_of<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    let mut found = None;
    let _ = T::deserialize(Introspect(&mut found));
    found.unwrap_or(&[])
}

/// A deserializer that only records the fields a struct asks for.
struct Introspect<'a>(&'a mut Option<&'static [&'static str]>);

/// The error [`Introspect`] ends every deserialization with.
#[derive(Debug)]
struct Stop;

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("field names read")
    }
}

impl std::error::Error for Stop {}

impl de::Error for Stop {
    fn custom<T: std::fmt::Display>(_: T) -> Self {
        Stop
    }
}

impl<'de> Deserializer<'de> for Introspect<'_> {
    type Error = Stop;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        Err(Stop)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Stop> {
        *self.0 = Some(fields);
        Err(Stop)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize)]
    #[allow(dead_code)]
    struct Example {
        model: String,
        #[serde(rename = "type")]
        kind: Option<String>,
    }

    #[test]
    fn a_structs_fields_are_read_from_its_deserialize_impl() {
        assert_eq!(fields_of::<Example>(), &["model", "type"]);
    }
}
