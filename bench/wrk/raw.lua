-- wrk script: POST real images to /v1/detect as raw bodies (Content-Type: image/jpeg), one image
-- per request, cycling through a list. Counting, latencies, open/closed loop and the JSON written
-- by done() are multipart.lua's.
--
-- Environment: WRK_IMAGES, WRK_OUT, WRK_RATE, WRK_PATH as in multipart.lua.
--
--   wrk -t64 -c64 -d30s --timeout 60s -s bench/wrk/raw.lua http://127.0.0.1:8000

local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "multipart.lua")
local multipart_init = init

function init(args)
  multipart_init(args) -- counters and schedule; its multipart requests are replaced below
  local path = os.getenv("WRK_PATH") or "/v1/detect"
  requests = {}
  for file in io.lines(os.getenv("WRK_IMAGES")) do
    if #file > 0 then
      local f = assert(io.open(file, "rb"))
      local data = f:read("*a")
      f:close()
      requests[#requests + 1] = wrk.format("POST", path, { ["Content-Type"] = "image/jpeg" }, data)
    end
  end
end
