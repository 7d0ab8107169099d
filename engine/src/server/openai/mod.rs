//! OpenAI's wire formats: the request shapes (with vLLM's extra sampling fields) and the
//! response shapes, as types.

mod fields;
pub mod request;
pub mod response;

pub use fields::fields_of;
