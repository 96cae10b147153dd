//! Tensors in serialized programs (`tumble compile`'s `.tumble` files: literals of the lowered
//! program). A tensor is written as its shape and its elements in one typed list; reading it back
//! checks that the two agree, so a corrupt file is an error, never a malformed tensor.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{Buffer, Tensor};

#[derive(Serialize, Deserialize)]
enum Elements {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    Bool(Vec<bool>),
}

#[derive(Serialize, Deserialize)]
struct Serial {
    shape: Vec<usize>,
    elements: Elements,
}

impl Serialize for Tensor {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let elements = match self.buffer() {
            Buffer::F32(v) => Elements::F32(v.clone()),
            Buffer::F64(v) => Elements::F64(v.clone()),
            Buffer::I32(v) => Elements::I32(v.clone()),
            Buffer::I64(v) => Elements::I64(v.clone()),
            Buffer::Bool(v) => Elements::Bool(v.clone()),
        };
        Serial {
            shape: self.shape().to_vec(),
            elements,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Tensor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Tensor, D::Error> {
        let Serial { shape, elements } = Serial::deserialize(d)?;
        let buffer = match elements {
            Elements::F32(v) => Buffer::F32(v),
            Elements::F64(v) => Buffer::F64(v),
            Elements::I32(v) => Buffer::I32(v),
            Elements::I64(v) => Buffer::I64(v),
            Elements::Bool(v) => Buffer::Bool(v),
        };
        Tensor::new(shape, buffer).map_err(serde::de::Error::custom)
    }
}
