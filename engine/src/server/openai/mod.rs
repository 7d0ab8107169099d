//! OpenAI's wire formats: the request shapes (with vLLM's extra sampling fields) and the
//! response shapes, as types, for the completion endpoints and the Responses API.

mod fields;
pub mod request;
pub mod response;
pub mod responses;

pub use fields::fields_of;
