//! Capture a region of a stream into a CUDA graph and replay it: the primitive under
//! `#[graph_scope]`. A captured region must use static buffers (the graph replays the same
//! addresses) and must have run once eagerly before (kernels compiled and loaded, cuBLAS
//! workspaces allocated); replay then gives the eager result bit for bit.

use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::Gpu;
use super::error::{CudaError, Result};

/// An instantiated graph of one stream's work.
pub struct Graph {
    graph: CudaGraph,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Graph")
    }
}

impl Graph {
    /// Runs `region` once on `gpu`'s stream while capturing it (nothing executes during
    /// capture), and instantiates the graph. While it runs, [`Gpu::capturing`] says `label`.
    /// An error inside `region` ends the capture and is returned; a region that queued nothing
    /// is an error too.
    pub fn capture<E>(
        gpu: &Gpu,
        label: &'static str,
        region: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<Graph, E>
    where
        E: From<CudaError>,
    {
        let stream = gpu.stream();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| CudaError::driver("cuStreamBeginCapture", e))?;
        gpu.set_capturing(Some(label));
        let body = region();
        gpu.set_capturing(None);
        let end = stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        body?;
        match end.map_err(|e| CudaError::driver("cuStreamEndCapture", e))? {
            Some(graph) => Ok(Graph { graph }),
            None => Err(CudaError::Driver {
                call: "cuStreamEndCapture".to_string(),
                message: "the captured region queued no work".to_string(),
            }
            .into()),
        }
    }

    /// Queues one replay on the stream the graph was captured on.
    pub fn replay(&self) -> Result<()> {
        self.graph
            .launch()
            .map_err(|e| CudaError::driver("cuGraphLaunch", e))
    }

    /// Uploads the graph to the device ahead of its first replay.
    pub fn upload(&self) -> Result<()> {
        self.graph
            .upload()
            .map_err(|e| CudaError::driver("cuGraphUpload", e))
    }
}
