-- Token bucket, one per API key, kept in Redis so every API replica draws from the same one.
-- KEYS[1] bucket hash {tokens, at}
-- ARGV[1] tokens per second   ARGV[2] bucket size (burst)
-- Returns 0 when a token was taken, else the milliseconds until one is available.
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_ms()
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens, at = tonumber(state[1]), tonumber(state[2])
if tokens == nil then
  tokens, at = burst, now
end
tokens = math.min(burst, tokens + (now - at) * rate / 1000)
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
else
  wait = math.ceil((1 - tokens) * 1000 / rate)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', now)
-- An idle bucket is full again after burst / rate seconds: it need not outlive that.
redis.call('PEXPIRE', KEYS[1], math.ceil(burst * 1000 / rate) + 1000)
return wait
