//! Thin wrappers over the MPI C calls this backend makes, turning return codes into
//! [`CommError::Backend`] and sizes into MPI's 32-bit counts (checked, never truncated).
//!
//! Every function here must be called with the runtime's MPI lock held (the library runs at
//! `MPI_THREAD_SERIALIZED`). None waits for other ranks: collectives are started here and
//! tested to completion by the caller, which lets the lock go between tests.

use std::ffi::{c_int, c_void};

use mpi::ffi;

use crate::comm::{CommError, Result};

/// A communicator handle.
pub(super) type RawComm = ffi::MPI_Comm;

/// A request handle.
pub(super) type RawRequest = ffi::MPI_Request;

/// Names a group and a call for errors.
#[derive(Debug, Clone, Copy)]
pub(super) struct Site<'a> {
    pub group: &'a str,
    pub call: &'static str,
}

impl Site<'_> {
    fn error(&self, message: String) -> CommError {
        CommError::Backend {
            group: self.group.to_string(),
            library: "MPI",
            call: self.call,
            message,
        }
    }

    /// Turns an MPI return code into a result.
    fn check(&self, code: c_int) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        Err(self.error(error_string(code)))
    }

    /// An element count or displacement as MPI's `int`.
    pub fn count(&self, n: usize) -> Result<c_int> {
        c_int::try_from(n).map_err(|_| {
            self.error(format!(
                "{n} elements exceed MPI's 32-bit counts (at most {}); use smaller buckets",
                c_int::MAX
            ))
        })
    }

    fn counts(&self, ns: &[usize]) -> Result<Vec<c_int>> {
        ns.iter().map(|&n| self.count(n)).collect()
    }
}

/// MPI's description of an error code.
fn error_string(code: c_int) -> String {
    let mut buf = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: MPI writes at most MPI_MAX_ERROR_STRING (< 512) bytes and their length.
    let ok = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) } == 0;
    if !ok {
        return format!("error code {code}");
    }
    buf.truncate(usize::try_from(len).unwrap_or(0).min(512));
    format!("{} (code {code})", String::from_utf8_lossy(&buf))
}

/// The MPI datatype moving elements of `size` bytes (as unsigned integers: a copy, no
/// arithmetic, so floats' bits pass unchanged).
pub(super) fn datatype(size: usize) -> ffi::MPI_Datatype {
    // SAFETY: reading the library's predefined datatype handles.
    unsafe {
        match size {
            1 => ffi::RSMPI_UINT8_T,
            2 => ffi::RSMPI_UINT16_T,
            4 => ffi::RSMPI_UINT32_T,
            8 => ffi::RSMPI_UINT64_T,
            _ => unreachable!("no element type is {size} bytes"),
        }
    }
}

/// Makes calls on `comm` return error codes instead of aborting the job.
pub(super) fn errors_return(comm: RawComm) {
    // SAFETY: `comm` is a valid communicator and the handler a predefined one.
    unsafe {
        ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN);
    }
}

/// A non-blocking collective MPI is running: its request, and the count and displacement
/// arrays MPI may read until it completes. Finish it with [`test`] on `request` until it says
/// so.
pub(super) struct Started {
    /// The collective's request.
    pub request: RawRequest,
    _arrays: Vec<Vec<c_int>>,
}

impl Started {
    /// A request that needs no arrays kept (a point-to-point one).
    pub fn of(request: RawRequest) -> Started {
        Started {
            request,
            _arrays: Vec::new(),
        }
    }
}

/// Starts `MPI_Ialltoallv` of elements of `size` bytes; counts and displacements in elements.
///
/// # Safety
/// `send` must hold the elements the send counts and displacements name and `recv` room for
/// the receive ones, both valid and not otherwise used until the collective completes.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn ialltoallv(
    site: Site<'_>,
    comm: RawComm,
    size: usize,
    send: *const u8,
    send_counts: &[usize],
    send_displs: &[usize],
    recv: *mut u8,
    recv_counts: &[usize],
    recv_displs: &[usize],
) -> Result<Started> {
    let (sc, sd) = (site.counts(send_counts)?, site.counts(send_displs)?);
    let (rc, rd) = (site.counts(recv_counts)?, site.counts(recv_displs)?);
    let t = datatype(size);
    // SAFETY: a request handle is plain data that MPI initialises.
    let mut request: RawRequest = unsafe { std::mem::zeroed() };
    // SAFETY: forwarded from the caller; the count arrays have one entry per member and live
    // in the returned `Started` until the request completes.
    site.check(unsafe {
        ffi::MPI_Ialltoallv(
            send.cast::<c_void>(),
            sc.as_ptr(),
            sd.as_ptr(),
            t,
            recv.cast::<c_void>(),
            rc.as_ptr(),
            rd.as_ptr(),
            t,
            comm,
            &mut request,
        )
    })?;
    Ok(Started {
        request,
        _arrays: vec![sc, sd, rc, rd],
    })
}

/// Starts `MPI_Iallgatherv` of elements of `size` bytes: `send_count` from this rank,
/// `counts[i]` from member i placed at `displs[i]` of `recv`.
///
/// # Safety
/// As [`ialltoallv`]; `send` must not overlap `recv`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn iallgatherv(
    site: Site<'_>,
    comm: RawComm,
    size: usize,
    send: *const u8,
    send_count: usize,
    recv: *mut u8,
    counts: &[usize],
    displs: &[usize],
) -> Result<Started> {
    let (c, d) = (site.counts(counts)?, site.counts(displs)?);
    let t = datatype(size);
    // SAFETY: a request handle is plain data that MPI initialises.
    let mut request: RawRequest = unsafe { std::mem::zeroed() };
    // SAFETY: forwarded from the caller; the arrays live in the returned `Started`.
    site.check(unsafe {
        ffi::MPI_Iallgatherv(
            send.cast::<c_void>(),
            site.count(send_count)?,
            t,
            recv.cast::<c_void>(),
            c.as_ptr(),
            d.as_ptr(),
            t,
            comm,
            &mut request,
        )
    })?;
    Ok(Started {
        request,
        _arrays: vec![c, d],
    })
}

/// Starts `MPI_Ibcast` of `count` elements of `size` bytes from member `root`.
///
/// # Safety
/// `buf` must hold `count` elements, valid and not otherwise used until the collective
/// completes.
pub(super) unsafe fn ibcast(
    site: Site<'_>,
    comm: RawComm,
    size: usize,
    buf: *mut u8,
    count: usize,
    root: usize,
) -> Result<Started> {
    // SAFETY: a request handle is plain data that MPI initialises.
    let mut request: RawRequest = unsafe { std::mem::zeroed() };
    // SAFETY: forwarded from the caller.
    site.check(unsafe {
        ffi::MPI_Ibcast(
            buf.cast::<c_void>(),
            site.count(count)?,
            datatype(size),
            site.count(root)?,
            comm,
            &mut request,
        )
    })?;
    Ok(Started {
        request,
        _arrays: Vec::new(),
    })
}

/// Starts sending `words` to member `dest` with `tag`.
///
/// # Safety
/// `words` must stay valid and unchanged until the returned request completes.
pub(super) unsafe fn isend(
    site: Site<'_>,
    comm: RawComm,
    words: &[u64],
    dest: usize,
    tag: c_int,
) -> Result<RawRequest> {
    // SAFETY: a request handle is plain data that MPI_Isend initialises.
    let mut request: RawRequest = unsafe { std::mem::zeroed() };
    // SAFETY: forwarded from the caller.
    site.check(unsafe {
        ffi::MPI_Isend(
            words.as_ptr().cast::<c_void>(),
            site.count(words.len())?,
            datatype(8),
            site.count(dest)?,
            tag,
            comm,
            &mut request,
        )
    })?;
    Ok(request)
}

/// Whether a request has completed (and is then freed by MPI).
pub(super) fn test(site: Site<'_>, request: &mut RawRequest) -> Result<bool> {
    let mut flag: c_int = 0;
    // SAFETY: `request` is an active request or MPI_REQUEST_NULL; the status is ignored.
    site.check(unsafe { ffi::MPI_Test(request, &mut flag, ffi::RSMPI_STATUS_IGNORE) })?;
    Ok(flag != 0)
}

/// Lets an unfinished request complete in the background (its buffer must then be leaked).
pub(super) fn release(request: &mut RawRequest) {
    // SAFETY: `request` is an active request; MPI frees it once it completes.
    unsafe {
        ffi::MPI_Request_free(request);
    }
}

/// The size in words of a message from member `source` with `tag` that has arrived, if any.
pub(super) fn probe_words(
    site: Site<'_>,
    comm: RawComm,
    source: usize,
    tag: c_int,
) -> Result<Option<usize>> {
    let mut flag: c_int = 0;
    // SAFETY: a status is plain data that MPI_Iprobe fills.
    let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
    // SAFETY: valid communicator, out-pointers to live locals.
    site.check(unsafe { ffi::MPI_Iprobe(site.count(source)?, tag, comm, &mut flag, &mut status) })?;
    if flag == 0 {
        return Ok(None);
    }
    let mut count: c_int = 0;
    // SAFETY: `status` describes the probed message.
    site.check(unsafe { ffi::MPI_Get_count(&status, datatype(8), &mut count) })?;
    Ok(Some(usize::try_from(count).unwrap_or(0)))
}

/// Starts receiving the message from member `source` with `tag` into `words` (whose length is
/// the probed size).
///
/// # Safety
/// `words` must stay valid, and be neither read nor written, until the request completes.
pub(super) unsafe fn irecv_words(
    site: Site<'_>,
    comm: RawComm,
    words: &mut [u64],
    source: usize,
    tag: c_int,
) -> Result<RawRequest> {
    // SAFETY: a request handle is plain data that MPI_Irecv initialises.
    let mut request: RawRequest = unsafe { std::mem::zeroed() };
    // SAFETY: `words` is a live, exclusive buffer of the given length (and stays so: caller).
    site.check(unsafe {
        ffi::MPI_Irecv(
            words.as_mut_ptr().cast::<c_void>(),
            site.count(words.len())?,
            datatype(8),
            site.count(source)?,
            tag,
            comm,
            &mut request,
        )
    })?;
    Ok(request)
}
