//! Counts the requests a store makes of its backend, by kind, so that an operation's cost can
//! be told in requests (what an S3 bill and an S3 rate limit count) as well as in time.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use futures::stream::{BoxStream, StreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, Result,
};
use serde::Serialize;

/// Objects an S3 listing returns per request at most.
pub const LIST_PAGE_OBJECTS: u64 = 1000;
/// Objects one S3 `DeleteObjects` request deletes at most.
pub const DELETE_BATCH_OBJECTS: u64 = 1000;

/// Requests made so far (or between two snapshots, by subtraction).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RequestCounts {
    pub get: u64,
    pub head: u64,
    pub put: u64,
    /// Objects deleted.
    pub deleted: u64,
    /// Delete requests as S3 makes them: one per 1,000 objects of a delete stream.
    pub delete: u64,
    /// Listing calls.
    pub list: u64,
    /// Objects and common prefixes those listings returned.
    pub listed: u64,
    pub copy: u64,
}

impl RequestCounts {
    /// Requests an S3 server would see, counting a listing as one request per page of up to
    /// 1,000 objects and a delete as one request per 1,000 objects.
    pub fn total(&self) -> u64 {
        self.get
            + self.head
            + self.put
            + self.delete
            + self.copy
            + self.list
            + self.listed / LIST_PAGE_OBJECTS
    }
}

impl std::ops::Sub for RequestCounts {
    type Output = Self;
    fn sub(self, earlier: Self) -> Self {
        Self {
            get: self.get - earlier.get,
            head: self.head - earlier.head,
            put: self.put - earlier.put,
            deleted: self.deleted - earlier.deleted,
            delete: self.delete - earlier.delete,
            list: self.list - earlier.list,
            listed: self.listed - earlier.listed,
            copy: self.copy - earlier.copy,
        }
    }
}

impl fmt::Display for RequestCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} requests ({} get, {} head, {} put, {} list returning {}, {} delete of {})",
            self.total(),
            self.get,
            self.head,
            self.put,
            self.list,
            self.listed,
            self.delete,
            self.deleted
        )
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    get: AtomicU64,
    head: AtomicU64,
    put: AtomicU64,
    deleted: AtomicU64,
    delete: AtomicU64,
    list: AtomicU64,
    listed: AtomicU64,
    copy: AtomicU64,
}

impl Counters {
    pub(crate) fn snapshot(&self) -> RequestCounts {
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        RequestCounts {
            get: read(&self.get),
            head: read(&self.head),
            put: read(&self.put),
            deleted: read(&self.deleted),
            delete: read(&self.delete),
            list: read(&self.list),
            listed: read(&self.listed),
            copy: read(&self.copy),
        }
    }

    /// A put made without `object_store` ([`super::direct`]).
    pub(crate) fn count_put(&self) {
        bump(&self.put, 1);
    }
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

/// An `ObjectStore` that passes every call to `inner` and counts it in `counters`.
#[derive(Debug)]
pub(crate) struct Counted {
    pub inner: Arc<dyn ObjectStore>,
    pub counters: Arc<Counters>,
}

impl fmt::Display for Counted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for Counted {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        options: PutOptions,
    ) -> Result<PutResult> {
        bump(&self.counters.put, 1);
        self.inner.put_opts(location, payload, options).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        options: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        bump(&self.counters.put, 1);
        self.inner.put_multipart_opts(location, options).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        let counter = if options.head {
            &self.counters.head
        } else {
            &self.counters.get
        };
        bump(counter, 1);
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        bump(&self.counters.get, ranges.len() as u64);
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        let counters = Arc::clone(&self.counters);
        let mut deleted = 0;
        self.inner
            .delete_stream(locations)
            .inspect(move |result| {
                if result.is_ok() {
                    if deleted % DELETE_BATCH_OBJECTS == 0 {
                        bump(&counters.delete, 1);
                    }
                    deleted += 1;
                    bump(&counters.deleted, 1);
                }
            })
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        bump(&self.counters.list, 1);
        self.count_listed(self.inner.list(prefix))
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        bump(&self.counters.list, 1);
        self.count_listed(self.inner.list_with_offset(prefix, offset))
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        bump(&self.counters.list, 1);
        let listing = self.inner.list_with_delimiter(prefix).await?;
        bump(
            &self.counters.listed,
            (listing.objects.len() + listing.common_prefixes.len()) as u64,
        );
        Ok(listing)
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        bump(&self.counters.copy, 1);
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> Result<()> {
        bump(&self.counters.copy, 1);
        self.inner.rename_opts(from, to, options).await
    }
}

impl Counted {
    fn count_listed(
        &self,
        listing: BoxStream<'static, Result<ObjectMeta>>,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        let counters = Arc::clone(&self.counters);
        listing
            .inspect(move |meta| {
                if meta.is_ok() {
                    bump(&counters.listed, 1);
                }
            })
            .boxed()
    }
}
