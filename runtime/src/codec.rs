//! The one serialization codec for control records (bincode 2, standard
//! configuration, with a size limit on decode). Tensor payloads never pass
//! through here: they travel as a small header and raw bytes.

use thiserror::Error;

/// Largest control record accepted on decode.
pub const MAX_RECORD: usize = 1 << 20;

/// A record could not be decoded.
#[derive(Debug, Error)]
#[error("malformed record: {0}")]
pub struct DecodeError(String);

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_RECORD>()
}

/// Encodes a control record.
pub fn encode<T: bincode::Encode>(value: &T) -> Vec<u8> {
    bincode::encode_to_vec(value, config()).expect("encoding into a Vec cannot fail")
}

/// Decodes a control record; trailing bytes are an error.
pub fn decode<T: bincode::Decode<()>>(bytes: &[u8]) -> Result<T, DecodeError> {
    let (value, used) = bincode::decode_from_slice(bytes, config()).map_err(|e| DecodeError(e.to_string()))?;
    if used != bytes.len() {
        return Err(DecodeError(format!("{} trailing bytes", bytes.len() - used)));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, bincode::Encode, bincode::Decode)]
    struct Sample {
        rank: u32,
        name: String,
    }

    #[test]
    fn roundtrip_and_rejects_garbage() {
        let sample = Sample {
            rank: 3,
            name: "node-a".into(),
        };
        let bytes = encode(&sample);
        assert_eq!(decode::<Sample>(&bytes).unwrap(), sample);
        assert!(decode::<Sample>(&bytes[..bytes.len() - 1]).is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode::<Sample>(&longer).is_err());
        // A forged string length must not allocate beyond the limit.
        assert!(decode::<Sample>(&[3, 0xfd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f]).is_err());
    }
}
