//! Authenticating what a rank publishes with the job secret.
//!
//! Anyone who can write to the store could publish a record naming their own
//! certificate. With a job secret (the library's `InitOptions::job_secret`,
//! by default `CHORUS_JOB_SECRET`, handed out by `chorus launch`), every rank signs its record with HMAC-SHA256 and checks
//! its peers' signatures before pinning their certificates, so a store writer
//! without the secret cannot join the mesh.

use aws_lc_rs::hmac;

/// `bytes` random bytes from the system's generator as lowercase hex: a
/// fresh job secret (`chorus launch` hands out 32 bytes' worth), a run id.
pub fn random_hex(bytes: usize) -> std::io::Result<String> {
    let mut buf = vec![0u8; bytes];
    aws_lc_rs::rand::fill(&mut buf).map_err(|_| std::io::Error::other("the system's random generator failed"))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// Length of a record's signature.
pub const TAG_LEN: usize = 32;

/// The job secret, as a signing key.
#[derive(Clone)]
pub struct JobSecret(hmac::Key);

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobSecret(..)")
    }
}

impl JobSecret {
    /// A key from the secret's bytes (any length; hex text works as is).
    pub fn new(secret: &[u8]) -> Self {
        Self(hmac::Key::new(hmac::HMAC_SHA256, secret))
    }

    /// The signature of `message`.
    pub fn sign(&self, message: &[u8]) -> [u8; TAG_LEN] {
        hmac::sign(&self.0, message)
            .as_ref()
            .try_into()
            .expect("HMAC-SHA256 is 32 bytes")
    }

    /// Whether `tag` signs `message` (compared in constant time).
    pub fn verify(&self, message: &[u8], tag: &[u8]) -> bool {
        hmac::verify(&self.0, message, tag).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_hex_is_lowercase_hex_of_the_length_asked_and_never_repeats() {
        let (a, b) = (random_hex(16).unwrap(), random_hex(16).unwrap());
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')), "{a}");
        assert_ne!(a, b);
    }

    #[test]
    fn only_the_same_secret_verifies() {
        let secret = JobSecret::new(b"abc123");
        let tag = secret.sign(b"record");
        assert!(secret.verify(b"record", &tag));
        assert!(!secret.verify(b"recorD", &tag));
        assert!(!JobSecret::new(b"abc124").verify(b"record", &tag));
        assert!(!secret.verify(b"record", &tag[..31]));
    }
}
