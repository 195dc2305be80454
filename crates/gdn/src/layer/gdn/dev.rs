//! The layer's GPU parameters as a model's optimizer sees them: the fp32 masters updated in place
//! on the device (AdamW on the GPU), the bf16 copies remade after each update, and the masters
//! downloaded when a checkpoint needs them ([`GatedDeltaNet::download_params`]).

use super::*;

impl GatedDeltaNet {
    /// Make sure the device copy of the parameters exists (uploads the host parameters once).
    pub(crate) fn ensure_dev_params(&self) -> Result<()> {
        self.view().map(|_| ())
    }

    /// The fp32 device masters, mutably, in parameter order (uploaded first if needed). Errors on
    /// a CPU layer, or while a forward's view of them is alive.
    pub(crate) fn dev_params_mut(&mut self) -> Result<Vec<(&str, &mut GBuf<f32>)>> {
        if self.gpu()?.is_none() {
            return Err(GdnError::Invalid(
                "the layer's parameters live on the host".into(),
            ));
        }
        self.ensure_dev_params()?;
        let d = self
            .dev_params
            .get_mut()
            .and_then(Arc::get_mut)
            .ok_or_else(|| GdnError::Device("the layer's device parameters are in use".into()))?;
        Ok(d.map.iter_mut().map(|(n, b)| (n.as_str(), b)).collect())
    }

    /// Remake the bf16 copies of the GEMM weights from the device masters (after an update).
    pub(crate) fn refresh_dev_bf16(&mut self) -> Result<()> {
        let dtype = self.dtype;
        match self.dev_params.get_mut() {
            None => Ok(()),
            Some(d) => Arc::get_mut(d)
                .ok_or_else(|| GdnError::Device("the layer's device parameters are in use".into()))?
                .refresh_bf16(dtype),
        }
    }

    /// Bytes of the device copies (fp32 masters and bf16 copies), 0 before they are made.
    pub(crate) fn dev_param_bytes(&self) -> usize {
        self.dev_params.get().map_or(0, |d| {
            d.map.iter().map(|(_, b)| b.bytes()).sum::<usize>()
                + d.bf16.iter().map(|(_, b)| b.bytes()).sum::<usize>()
        })
    }
}

impl GatedDeltaNet {
    /// The parameters from where they live: the device masters when they exist, else the host
    /// copy.
    pub(crate) fn download_params(&self) -> Result<Params> {
        let Some(d) = self.dev_params.get() else {
            return Ok(self.params.clone());
        };
        let mut p = self.params.clone();
        for (name, b) in &d.map {
            let host = d.gpu.download(b)?;
            p.get_mut(name)
                .ok_or_else(|| GdnError::Invalid(format!("no parameter {name}")))?
                .data_mut()
                .copy_from_slice(&host);
        }
        Ok(p)
    }
}

impl DeviceGrads {
    /// (name, shape, buffer) in the parameters' order, owned.
    pub(crate) fn into_entries(self) -> Vec<(String, Vec<usize>, GBuf<f32>)> {
        self.entries
    }
}
