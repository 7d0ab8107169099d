-- Argo CD health check for serving.ferrite.dev/LLMService, driven by its Ready condition.
--
--   no status yet, or status of an older generation   -> Progressing
--   Ready=True                                        -> Healthy
--   Ready=False, reason NoReplicas (scaled to 0)      -> Healthy
--   Ready=False, reason EngineStartupFailed or
--                ModelDownloadFailed                  -> Degraded (a pod failed; the message says why)
--   Ready=False, any other reason (loading, rolling,
--                scaling up)                          -> Progressing
--
-- Install it under resource.customizations.health.serving.ferrite.dev_LLMService in the
-- argocd-cm ConfigMap (argocd-cm.yaml beside this file carries the same text).
local hs = {}
if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Ferrite operator to report status"
  return hs
end
local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the Ferrite operator to observe generation " .. tostring(generation)
  return hs
end
local failures = { EngineStartupFailed = true, ModelDownloadFailed = true }
if obj.status.conditions ~= nil then
  for _, c in ipairs(obj.status.conditions) do
    if c.type == "Ready" then
      local message = c.message or ""
      if c.status == "True" then
        hs.status = "Healthy"
      elseif c.reason == "NoReplicas" then
        hs.status = "Healthy"
      elseif failures[c.reason] then
        hs.status = "Degraded"
      else
        hs.status = "Progressing"
      end
      hs.message = message
      return hs
    end
  end
end
hs.status = "Progressing"
hs.message = "Waiting for the Ready condition"
return hs
