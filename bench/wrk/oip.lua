-- wrk script: POST real images to the Open Inference Protocol's infer endpoint as Triton's
-- binary tensor data (what tritonclient.http sends): a JSON header naming input "image"
-- (BYTES, shape [1]) followed by the image as one BYTES element (4-byte little-endian length,
-- then the bytes), binary outputs asked for. One image per request, cycling through a list.
-- Counting, latencies, open/closed loop and the JSON written by done() are multipart.lua's.
--
-- Environment: WRK_IMAGES, WRK_OUT, WRK_RATE as in multipart.lua;
--   WRK_PATH    request path (default /v2/models/yolopipe/infer)
--
--   wrk -t64 -c64 -d30s --timeout 60s -s bench/wrk/oip.lua http://127.0.0.1:8000

local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "multipart.lua")
local multipart_init = init

local function le32(n)
  return string.char(n % 256, math.floor(n / 256) % 256, math.floor(n / 65536) % 256, math.floor(n / 16777216) % 256)
end

function init(args)
  multipart_init(args) -- counters and schedule; its multipart requests are replaced below
  local path = os.getenv("WRK_PATH") or "/v2/models/yolopipe/infer"
  requests = {}
  for file in io.lines(os.getenv("WRK_IMAGES")) do
    if #file > 0 then
      local f = assert(io.open(file, "rb"))
      local data = f:read("*a")
      f:close()
      local tensor = le32(#data) .. data
      local header = '{"inputs":[{"name":"image","shape":[1],"datatype":"BYTES","parameters":{"binary_data_size":'
        .. #tensor .. '}}],"parameters":{"binary_data_output":true}}'
      requests[#requests + 1] = wrk.format("POST", path, {
        ["Content-Type"] = "application/octet-stream",
        ["Inference-Header-Content-Length"] = tostring(#header),
      }, header .. tensor)
    end
  end
end
