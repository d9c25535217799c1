//! Opens an `object_store` backend from a URL.
//!
//! | URL | backend | durability |
//! | --- | --- | --- |
//! | `file:///abs/path` | `LocalFileSystem` with fsync | every put fsyncs the file and each directory it created before returning |
//! | `s3://bucket/prefix` | `AmazonS3` (any S3-compatible server) | the server's; commit records use `If-None-Match: *` |
//! | `memory://` | `InMemory`, for tests | none |
//!
//! S3 settings come from the standard `AWS_*` environment variables, overridden by
//! [`S3Settings`]. Credentials must be given explicitly: this module never falls back to
//! instance-metadata discovery, which would hang on a machine that has none.

use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::prefix::PrefixStore;
use object_store::{ClientOptions, ObjectStore, RetryConfig};

use crate::error::StoreError;

/// S3 options that flags can set; `None` means "take it from the environment".
#[derive(Clone, Debug, Default)]
pub struct S3Settings {
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub allow_http: Option<bool>,
}

/// Whether opening a `file://` store may create its directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenMode {
    /// The store must already exist (readers, operator commands).
    Existing,
    /// Create the directory if needed (writers).
    CreateIfMissing,
}

fn invalid(url: &str, reason: impl Into<String>) -> StoreError {
    StoreError::InvalidUrl { url: url.to_string(), reason: reason.into() }
}

pub(crate) fn open(url: &str, mode: OpenMode, s3: &S3Settings, retries: usize) -> Result<Arc<dyn ObjectStore>, StoreError> {
    let parsed = url::Url::parse(url).map_err(|error| invalid(url, format!("{error}; expected file:///path, s3://bucket/prefix or memory://")))?;
    match parsed.scheme() {
        "memory" => Ok(Arc::new(InMemory::new())),
        "file" => {
            if parsed.host_str().is_some_and(|host| !host.is_empty() && host != "localhost") {
                return Err(invalid(url, "file URLs take an absolute path: file:///path (three slashes)"));
            }
            let path = parsed.to_file_path().map_err(|()| invalid(url, "not an absolute local path"))?;
            if mode == OpenMode::CreateIfMissing {
                std::fs::create_dir_all(&path).map_err(|source| StoreError::Io { path: path.display().to_string(), source })?;
            } else if !path.is_dir() {
                return Err(invalid(url, format!("{} is not a directory; check the path, or write a checkpoint there first", path.display())));
            }
            let local = LocalFileSystem::new_with_prefix(&path)
                .map_err(|source| StoreError::Backend { operation: "open", path: path.display().to_string(), source })?
                .with_fsync(true)
                .with_automatic_cleanup(true);
            Ok(Arc::new(local))
        }
        "s3" => {
            let bucket = parsed.host_str().filter(|b| !b.is_empty()).ok_or_else(|| invalid(url, "no bucket: use s3://bucket/prefix"))?;
            let mut builder = AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .with_retry(RetryConfig { max_retries: retries, retry_timeout: Duration::from_secs(60), ..RetryConfig::default() })
                .with_client_options(ClientOptions::new().with_connect_timeout(Duration::from_secs(5)).with_timeout(Duration::from_secs(120)));
            if let Some(endpoint) = &s3.endpoint {
                builder = builder.with_endpoint(endpoint);
            }
            if let Some(region) = &s3.region {
                builder = builder.with_region(region);
            }
            if let Some(allow) = s3.allow_http {
                builder = builder.with_allow_http(allow);
            }
            let has_key = builder.get_config_value(&AmazonS3ConfigKey::AccessKeyId).is_some_and(|k| !k.is_empty())
                && builder.get_config_value(&AmazonS3ConfigKey::SecretAccessKey).is_some_and(|k| !k.is_empty());
            let unsigned = builder.get_config_value(&AmazonS3ConfigKey::SkipSignature).is_some_and(|v| v == "true");
            if !has_key && !unsigned {
                return Err(invalid(url, "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT for a non-AWS server)"));
            }
            let store = builder.build().map_err(|error| invalid(url, error.to_string()))?;
            let prefix = parsed.path().trim_matches('/');
            if prefix.is_empty() {
                Ok(Arc::new(store))
            } else {
                Ok(Arc::new(PrefixStore::new(store, prefix)))
            }
        }
        other => Err(invalid(url, format!("unknown scheme {other:?}; expected file, s3 or memory"))),
    }
}
