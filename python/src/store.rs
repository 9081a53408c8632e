//! chorus's [`Store`] over a `torch.distributed.Store` object: the store
//! torch made for `init_process_group` (a `PrefixStore` over a `TCPStore`,
//! a `FileStore`, a `HashStore`), so chorus's rendezvous runs in the same
//! place as the rest of the job's keys. Each call runs on a blocking thread
//! that holds the GIL only while torch's method runs (torch releases it
//! while a store call waits).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use chorus::store::{Store, StoreError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// A torch store, seen as a chorus store.
pub(crate) struct TorchStore {
    store: Arc<Py<PyAny>>,
    location: String,
    timeout: Duration,
}

impl fmt::Debug for TorchStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TorchStore({})", self.location)
    }
}

/// A Python exception as text: its class and message.
fn describe(py: Python<'_>, error: PyErr) -> String {
    let kind = error.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
    format!("{kind}: {}", error.value(py))
}

/// What a Python call failed with, as the store error it stands for.
fn store_error(location: &str, keys: &[&str], waited: Duration, text: String) -> StoreError {
    if text.to_ascii_lowercase().contains("timeout") || text.to_ascii_lowercase().contains("timed out") {
        StoreError::Timeout {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            location: location.to_string(),
            waited,
        }
    } else {
        StoreError::Io {
            location: location.to_string(),
            source: std::io::Error::other(text),
        }
    }
}

impl TorchStore {
    /// Wraps `store`, whose `timeout` bounds its blocking calls.
    pub(crate) fn new(py: Python<'_>, store: Py<PyAny>) -> PyResult<Self> {
        let bound = store.bind(py);
        let timeout = bound
            .getattr("timeout")?
            .call_method0("total_seconds")?
            .extract::<f64>()?;
        let location = format!("torch {}", bound.get_type().name()?);
        Ok(Self {
            store: Arc::new(store),
            location,
            timeout: Duration::from_secs_f64(timeout.max(0.0)),
        })
    }

    /// Runs `call` on the store under the GIL, on a blocking thread.
    async fn call<T, F>(&self, keys: &[&str], waited: Duration, call: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: for<'py> FnOnce(&Bound<'py, PyAny>) -> PyResult<T> + Send + 'static,
    {
        let store = self.store.clone();
        let outcome =
            tokio::task::spawn_blocking(move || Python::attach(|py| call(store.bind(py)).map_err(|e| describe(py, e))))
                .await;
        match outcome {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(store_error(&self.location, keys, waited, error)),
            Err(join) => Err(StoreError::Io {
                location: self.location.clone(),
                source: std::io::Error::other(format!("the store call did not finish: {join}")),
            }),
        }
    }
}

fn timedelta<'py>(py: Python<'py>, timeout: Duration) -> PyResult<Bound<'py, PyAny>> {
    py.import("datetime")?
        .getattr("timedelta")?
        .call1((0, timeout.as_secs_f64()))
}

fn owned(keys: &[&str]) -> Vec<String> {
    keys.iter().map(|k| k.to_string()).collect()
}

#[async_trait]
impl Store for TorchStore {
    fn location(&self) -> String {
        self.location.clone()
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let (k, v) = (key.to_string(), value.to_vec());
        self.call(&[key], Duration::ZERO, move |s| {
            s.call_method1("set", (k, PyBytes::new(s.py(), &v))).map(drop)
        })
        .await
    }

    async fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Bytes, StoreError> {
        let k = key.to_string();
        self.call(&[key], timeout, move |s| {
            s.call_method1("wait", (vec![k.clone()], timedelta(s.py(), timeout)?))?;
            Ok(Bytes::from(s.call_method1("get", (k,))?.extract::<Vec<u8>>()?))
        })
        .await
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let k = key.to_string();
        self.call(&[key], Duration::ZERO, move |s| {
            s.call_method1("add", (k, delta))?.extract()
        })
        .await
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Bytes, StoreError> {
        let (k, e, d) = (key.to_string(), expected.to_vec(), desired.to_vec());
        self.call(&[key], Duration::ZERO, move |s| {
            let py = s.py();
            let value = s.call_method1("compare_set", (k, PyBytes::new(py, &e), PyBytes::new(py, &d)))?;
            Ok(Bytes::from(value.extract::<Vec<u8>>()?))
        })
        .await
    }

    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let ks = owned(keys);
        self.call(keys, Duration::ZERO, move |s| s.call_method1("check", (ks,))?.extract())
            .await
    }

    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let ks = owned(keys);
        self.call(keys, timeout, move |s| {
            s.call_method1("wait", (ks, timedelta(s.py(), timeout)?)).map(drop)
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let k = key.to_string();
        self.call(&[key], Duration::ZERO, move |s| {
            s.call_method1("delete_key", (k,))?.extract()
        })
        .await
    }

    async fn num_keys(&self) -> Result<i64, StoreError> {
        self.call(&[], Duration::ZERO, |s| s.call_method0("num_keys")?.extract())
            .await
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Bytes>, StoreError> {
        let ks = owned(keys);
        let timeout = self.timeout;
        self.call(keys, timeout, move |s| {
            s.call_method1("wait", (ks.clone(), timedelta(s.py(), timeout)?))?;
            let values = s.call_method1("multi_get", (ks,))?;
            values
                .cast::<PyList>()?
                .iter()
                .map(|v| Ok(Bytes::from(v.extract::<Vec<u8>>()?)))
                .collect()
        })
        .await
    }

    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        let keys: Vec<String> = pairs.iter().map(|(k, _)| k.to_string()).collect();
        let values: Vec<Vec<u8>> = pairs.iter().map(|(_, v)| v.to_vec()).collect();
        let named: Vec<&str> = pairs.iter().map(|(k, _)| *k).collect();
        self.call(&named, Duration::ZERO, move |s| {
            let py = s.py();
            let values: Vec<Bound<'_, PyBytes>> = values.iter().map(|v| PyBytes::new(py, v)).collect();
            s.call_method1("multi_set", (keys, values)).map(drop)
        })
        .await
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let (k, v) = (key.to_string(), value.to_vec());
        self.call(&[key], Duration::ZERO, move |s| {
            s.call_method1("append", (k, PyBytes::new(s.py(), &v))).map(drop)
        })
        .await
    }

    async fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let (k, v) = (key.to_string(), value.to_vec());
        self.call(&[key], Duration::ZERO, move |s| {
            s.call_method1("queue_push", (k, PyBytes::new(s.py(), &v))).map(drop)
        })
        .await
    }

    async fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Bytes>, StoreError> {
        let k = key.to_string();
        self.call(&[key], self.timeout, move |s| {
            if !block && s.call_method1("queue_len", (k.clone(),))?.extract::<i64>()? == 0 {
                return Ok(None);
            }
            let value = s.call_method1("queue_pop", (k, block))?;
            Ok(Some(Bytes::from(value.extract::<Vec<u8>>()?)))
        })
        .await
    }

    async fn queue_len(&self, key: &str) -> Result<i64, StoreError> {
        let k = key.to_string();
        self.call(&[key], Duration::ZERO, move |s| {
            s.call_method1("queue_len", (k,))?.extract()
        })
        .await
    }
}
