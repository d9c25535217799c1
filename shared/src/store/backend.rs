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

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::prefix::PrefixStore;
use object_store::{ClientConfigKey, ClientOptions, ObjectStore, RetryConfig};

use crate::error::StoreError;

/// S3 options that flags can set; `None` means "take it from the environment".
#[derive(Clone, Debug, Default)]
pub struct S3Settings {
    pub endpoint: Option<String>,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
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
    StoreError::InvalidUrl {
        url: url.to_string(),
        reason: reason.into(),
    }
}

/// An opened backend; `local_root` is the directory of a `file://` store.
pub(crate) struct Backend {
    pub objects: Arc<dyn ObjectStore>,
    pub local_root: Option<PathBuf>,
}

pub(crate) fn open(
    url: &str,
    mode: OpenMode,
    s3: &S3Settings,
    retries: usize,
) -> Result<Backend, StoreError> {
    let objects = |objects: Arc<dyn ObjectStore>| Backend {
        objects,
        local_root: None,
    };
    let parsed = url::Url::parse(url).map_err(|error| {
        invalid(
            url,
            format!("{error}; expected file:///path, s3://bucket/prefix or memory://"),
        )
    })?;
    match parsed.scheme() {
        "memory" => Ok(objects(Arc::new(InMemory::new()))),
        "file" => {
            if parsed
                .host_str()
                .is_some_and(|host| !host.is_empty() && host != "localhost")
            {
                return Err(invalid(
                    url,
                    "file URLs take an absolute path: file:///path (three slashes)",
                ));
            }
            let path = parsed
                .to_file_path()
                .map_err(|()| invalid(url, "not an absolute local path"))?;
            if mode == OpenMode::CreateIfMissing {
                std::fs::create_dir_all(&path).map_err(|source| StoreError::Io {
                    path: path.display().to_string(),
                    cause: source,
                })?;
            } else if !path.is_dir() {
                return Err(invalid(
                    url,
                    format!(
                        "{} is not a directory; check the path, or write a checkpoint there first",
                        path.display()
                    ),
                ));
            }
            let local = LocalFileSystem::new_with_prefix(&path)
                .map_err(|source| StoreError::Backend {
                    operation: "open",
                    path: path.display().to_string(),
                    cause: source,
                })?
                .with_fsync(true)
                // Removing emptied directories races with a writer creating a file in one
                // (found by the gc race test); empty directories cost nothing.
                .with_automatic_cleanup(false);
            Ok(Backend {
                objects: Arc::new(local),
                local_root: Some(path),
            })
        }
        "s3" => {
            // TLS through rustls with ring (see the workspace manifest); the first store
            // opened installs it for the process, later calls find it there.
            let _ = rustls::crypto::ring::default_provider().install_default();
            let bucket = parsed
                .host_str()
                .filter(|b| !b.is_empty())
                .ok_or_else(|| invalid(url, "no bucket: use s3://bucket/prefix"))?;
            let mut builder = AmazonS3Builder::from_env();
            // Replacing the client options drops what the environment set, so carry it over.
            let env_allow_http = builder
                .get_config_value(&AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp))
                .is_some_and(|v| v == "true");
            let client = ClientOptions::new()
                .with_allow_http(s3.allow_http.unwrap_or(env_allow_http))
                .with_connect_timeout(Duration::from_secs(5))
                .with_timeout(Duration::from_secs(120));
            builder = builder
                .with_bucket_name(bucket)
                .with_retry(RetryConfig {
                    max_retries: retries,
                    retry_timeout: Duration::from_secs(60),
                    ..RetryConfig::default()
                })
                .with_client_options(client);
            if let Some(endpoint) = &s3.endpoint {
                builder = builder.with_endpoint(endpoint);
            }
            if let Some(key) = &s3.access_key_id {
                builder = builder.with_access_key_id(key);
            }
            if let Some(secret) = &s3.secret_access_key {
                builder = builder.with_secret_access_key(secret);
            }
            if let Some(region) = &s3.region {
                builder = builder.with_region(region);
            }
            let has_key = builder
                .get_config_value(&AmazonS3ConfigKey::AccessKeyId)
                .is_some_and(|k| !k.is_empty())
                && builder
                    .get_config_value(&AmazonS3ConfigKey::SecretAccessKey)
                    .is_some_and(|k| !k.is_empty());
            let unsigned = builder
                .get_config_value(&AmazonS3ConfigKey::SkipSignature)
                .is_some_and(|v| v == "true");
            if !has_key && !unsigned {
                return Err(invalid(url, "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT for a non-AWS server)"));
            }
            let store = builder
                .build()
                .map_err(|error| invalid(url, error.to_string()))?;
            let prefix = parsed.path().trim_matches('/');
            if prefix.is_empty() {
                Ok(objects(Arc::new(store)))
            } else {
                Ok(objects(Arc::new(PrefixStore::new(store, prefix))))
            }
        }
        other => Err(invalid(
            url,
            format!("unknown scheme {other:?}; expected file, s3 or memory"),
        )),
    }
}
