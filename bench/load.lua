-- wrk script for bench/load.py: a mix of Prometheus scrapes, /choose advice and /gpus.
-- Every response that is not 200 is counted by wrk as "Non-2xx or 3xx responses".
local paths = {
  "/metrics", "/choose?n=1&lease=0", "/choose?n=1&lease=0", "/gpus",
  "/metrics", "/choose?n=2&lease=0&format=json", "/choose?n=1&lease=0&sort=util", "/readyz",
}
local i = 0

request = function()
  i = i + 1
  return wrk.format("GET", paths[(i % #paths) + 1])
end
