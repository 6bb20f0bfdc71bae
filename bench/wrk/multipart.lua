-- wrk script: POST real images as multipart/form-data (field "image"), one image per request,
-- cycling through a list; counts answers by status and, with one connection per thread,
-- records the latency of every 200 (so that p99 of the 200s is known apart from fast 503s).
--
-- Environment:
--   WRK_IMAGES  a file listing image paths, one per line (required)
--   WRK_OUT     where done() writes JSON: statuses, wrk's own summary, the 200s' latencies (ms)
--   WRK_RATE    requests/s of each thread (open loop: a fixed schedule per thread; 0 or unset:
--               closed loop, each connection sends again as soon as it is answered)
--   WRK_PATH    request path (default /v1/detect)
--
-- bench/http_load.py drives it:
--   wrk -t64 -c64 -d30s --timeout 60s -s bench/wrk/multipart.lua http://127.0.0.1:8000

local ffi = require("ffi")
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } wrk_timespec;
int clock_gettime(int clk_id, wrk_timespec *tp);
]]
local ts = ffi.new("wrk_timespec")
local function now()
  ffi.C.clock_gettime(1, ts) -- CLOCK_MONOTONIC
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

local threads = {}

function setup(thread)
  threads[#threads + 1] = thread
end

function init(args)
  local list = assert(os.getenv("WRK_IMAGES"), "set WRK_IMAGES to a file listing images")
  local path = os.getenv("WRK_PATH") or "/v1/detect"
  local boundary = "yolopipe-wrk-boundary-7d1c2b"
  requests = {}
  for file in io.lines(list) do
    if #file > 0 then
      local f = assert(io.open(file, "rb"))
      local data = f:read("*a")
      f:close()
      local name = file:match("([^/]+)$")
      local body = "--" .. boundary .. "\r\n"
        .. 'Content-Disposition: form-data; name="image"; filename="' .. name .. '"\r\n'
        .. "Content-Type: image/jpeg\r\n\r\n" .. data .. "\r\n--" .. boundary .. "--\r\n"
      requests[#requests + 1] = wrk.format("POST", path,
        { ["Content-Type"] = "multipart/form-data; boundary=" .. boundary }, body)
    end
  end
  assert(#requests > 0, "no images listed in " .. list)
  statuses = {}
  lat200 = {}
  sent = 0
  sent_at = nil
  rate = tonumber(os.getenv("WRK_RATE") or "0") or 0
  schedule_start = nil
end

function delay()
  if rate <= 0 then
    return 0
  end
  -- the thread's k-th request is due at start + k/rate; a late one goes at once (catches up)
  local t = now()
  schedule_start = schedule_start or t
  local due = schedule_start + sent / rate
  return math.max(0, (due - t) * 1000)
end

function request()
  sent = sent + 1
  sent_at = now()
  return requests[(sent % #requests) + 1]
end

function response(status, headers, body)
  local key = tostring(status)
  statuses[key] = (statuses[key] or 0) + 1
  if status == 200 and sent_at ~= nil and rate <= 0 then
    -- one connection per thread: this answers the request sent at sent_at
    lat200[#lat200 + 1] = (now() - sent_at) * 1000
  end
end

function done(summary, latency, requests_stats)
  local out_path = os.getenv("WRK_OUT")
  if not out_path then
    return
  end
  local total = {}
  local samples = {}
  for _, thread in ipairs(threads) do
    for k, v in pairs(thread:get("statuses")) do
      total[k] = (total[k] or 0) + v
    end
    for _, v in ipairs(thread:get("lat200")) do
      samples[#samples + 1] = string.format("%.3f", v)
    end
  end
  local parts = {}
  for k, v in pairs(total) do
    parts[#parts + 1] = string.format('"%s": %d', k, v)
  end
  local e = summary.errors
  local f = assert(io.open(out_path, "w"))
  f:write("{")
  f:write(string.format('"duration_s": %.3f, "requests": %d, "bytes": %d, ', summary.duration / 1e6,
    summary.requests, summary.bytes))
  f:write(string.format('"socket_errors": {"connect": %d, "read": %d, "write": %d, "timeout": %d}, ',
    e.connect, e.read, e.write, e.timeout))
  f:write(string.format('"wrk_latency_ms": {"p50": %.3f, "p99": %.3f, "p999": %.3f, "max": %.3f}, ',
    latency:percentile(50) / 1000, latency:percentile(99) / 1000, latency:percentile(99.9) / 1000,
    latency.max / 1000))
  f:write('"statuses": {' .. table.concat(parts, ", ") .. "}, ")
  f:write('"lat200_ms": [' .. table.concat(samples, ",") .. "]")
  f:write("}\n")
  f:close()
end
