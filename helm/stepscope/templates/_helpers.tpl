{{/* Chart name, truncated to the 63 characters Kubernetes names allow. */}}
{{- define "stepscope.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name, unless the release name already contains the chart name. */}}
{{- define "stepscope.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The namespace every object goes to: namespaceOverride (an umbrella chart's choice), else the release's. */}}
{{- define "stepscope.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride }}
{{- end }}

{{- define "stepscope.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "stepscope.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stepscope.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The `helm test` pod's own labels, which the NetworkPolicy lets reach the exporter: not the exporter's selector
labels, so that the Service and a PodMonitor never select it. */}}
{{- define "stepscope.testPodSelectorLabels" -}}
app.kubernetes.io/name: {{ include "stepscope.name" . }}-test
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "stepscope.labels" -}}
helm.sh/chart: {{ include "stepscope.chart" . }}
{{ include "stepscope.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: exporter
app.kubernetes.io/part-of: stepscope
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The chart's labels with the user's extra labels, as one YAML map: (list $ (list "podLabels" .Values.podLabels)
...). Each extra map was written after the chart's labels, so a label the chart sets came twice in one mapping,
which the API server refuses (and a tool keeping the last value changed the selector labels the DaemonSet,
the Service and the monitors select the exporter by). A label the chart sets is refused, naming the setting;
two settings may give one label only the same value. */}}
{{- define "stepscope.labelsWith" -}}
{{- $root := index . 0 }}
{{- $labels := include "stepscope.labels" $root | fromYaml }}
{{- $selectorLabels := include "stepscope.selectorLabels" $root | fromYaml }}
{{- $setBy := dict }}
{{- range $source := rest . }}
{{- $setting := index $source 0 }}
{{- range $key, $value := index $source 1 }}
{{- if hasKey $setBy $key }}
{{- if ne (get $labels $key) $value }}
{{- fail (printf "%s sets the label %s to %q, and %s to %q: the object carries one value; make them agree" $setting $key $value (get $setBy $key) (get $labels $key)) }}
{{- end }}
{{- else if hasKey $labels $key }}
{{- fail (printf "%s sets the label %s, which the chart sets itself (%s: %s%s): the object would carry the key twice, which Kubernetes refuses; leave it out" $setting $key $key (get $labels $key) (ternary ", a selector label the exporter's pods are found by" "" (hasKey $selectorLabels $key))) }}
{{- end }}
{{- $_ := set $labels $key $value }}
{{- $_ := set $setBy $key $setting }}
{{- end }}
{{- end }}
{{- toYaml $labels }}
{{- end }}

{{- define "stepscope.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "stepscope.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* gpuNodesOnly: the nodes GPU feature discovery (nvidia.com/gpu.present) or Node Feature Discovery (PCI
vendor 10de) labelled, as a NodeAffinity. */}}
{{- define "stepscope.gpuNodeAffinity" -}}
requiredDuringSchedulingIgnoredDuringExecution:
  nodeSelectorTerms:
    - matchExpressions:
        - key: nvidia.com/gpu.present
          operator: In
          values: ["true"]
    - matchExpressions:
        - key: feature.node.kubernetes.io/pci-10de.present
          operator: In
          values: ["true"]
{{- end }}

{{/* repository@digest when image.digest pins one (the tag is then only a note for people), else repository:tag. */}}
{{- define "stepscope.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion (include "stepscope.imageTag" .Values.image.tag)) }}
{{- end }}
{{- end }}

{{/* An image tag as text. `--set image.tag=2` makes it a number (int64; float64 where the values came as JSON or
YAML), which printf "%s" would write as %!s(int64=2) and {{ . }} as 2.0240101e+07 for a float64 20240101; the
schema admits whole numbers only, so the digits are the tag. */}}
{{- define "stepscope.imageTag" -}}
{{- if has (kindOf .) (list "int" "int64" "float64") }}{{ int64 . }}{{ else if . }}{{ . }}{{ end }}
{{- end }}

{{/* Fails on an extraArgs flag that fights a flag the chart renders from a value: a collector switch beside the
chart's --collectors makes every exporter exit at start ("--collectors node,gpu,process and --no-collector.gpu
disagree"), and a listen address of its own leaves the container port, the hostPort and the probes on `port`, so
the kubelet restarts every exporter for failing its liveness probe; a telemetry path of its own leaves the monitors
scraping /metrics, which answers 404. */}}
{{- define "stepscope.checkExtraArgs" -}}
{{- $monitored := or (include "stepscope.serviceMonitorEnabled" .) (include "stepscope.podMonitorEnabled" .) }}
{{- range .Values.extraArgs }}
{{- if regexMatch "^--(no-)?collector\\.(node|gpu|process)(=|$)" . }}
{{- fail (printf "extraArgs %s: the chart passes --collectors from the value collectors, and the exporter refuses a collector switch beside it (every exporter would exit at start); set collectors instead" .) }}
{{- end }}
{{- if regexMatch "^--(web\\.)?listen-address(=|$)" . }}
{{- fail (printf "extraArgs %s: the value port sets the listen address together with the container port, the hostPort and the probes; set port instead" .) }}
{{- end }}
{{- if and (regexMatch "^--web\\.telemetry-path(=|$)" .) $monitored }}
{{- fail (printf "extraArgs %s: the ServiceMonitor/PodMonitor scrape /metrics, which then answers 404; keep the exporter's path, or set serviceMonitor.enabled and podMonitor.enabled false and scrape it yourself" .) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The Secret holding the ingest token: the user's, or the one this chart generates. */}}
{{- define "stepscope.ingestSecretName" -}}
{{- default (printf "%s-ingest" (include "stepscope.fullname" .)) .Values.ingest.token.existingSecret }}
{{- end }}

{{- define "stepscope.ingestSecretKey" -}}
{{- .Values.ingest.token.key }}
{{- end }}

{{/* The token of the Secret this chart generates, base64: the cluster's (lookup, kept across upgrades), else 40
random characters. Drawn once per render and kept in .Values, so that the Secret and the DaemonSet's checksum of
it see the same token (each include would draw its own). */}}
{{- define "stepscope.generatedIngestToken" -}}
{{- $state := .Values.ingest.token }}
{{- if not (hasKey $state "_rendered") }}
{{- $existing := lookup "v1" "Secret" (include "stepscope.namespace" .) (include "stepscope.ingestSecretName" .) }}
{{- $token := dig "data" (include "stepscope.ingestSecretKey" .) "" $existing }}
{{- $_ := set $state "_rendered" ($token | default (randAlphaNum 40 | b64enc)) }}
{{- end }}
{{- get $state "_rendered" }}
{{- end }}

{{- define "stepscope.ingestTokenDir" -}}
/etc/stepscope/ingest
{{- end }}

{{/*
"true" when a Prometheus Operator object should render: `auto` follows the cluster's API, true/false are
obeyed as given. Called with (list setting $ kind). `auto` asks for the kind itself
(monitoring.coreos.com/v1/<kind>, which Helm lists for a live cluster): a cluster may serve ServiceMonitor and
PodMonitor without PrometheusRule (each CRD is installed on its own), and the group alone rendered a
PrometheusRule it could not create. Where the list names no kind of the group at all (`helm template
--api-versions monitoring.coreos.com/v1`), the group/version stands for all of them, as before.
*/}}
{{- define "stepscope.operatorObjectEnabled" -}}
{{- $setting := toString (index . 0) }}
{{- $root := index . 1 }}
{{- $kind := index . 2 }}
{{- if eq $setting "auto" }}
{{- $group := "monitoring.coreos.com/v1" }}
{{- $kindsListed := false }}
{{- range $root.Capabilities.APIVersions }}
{{- if hasPrefix (printf "%s/" $group) . }}{{ $kindsListed = true }}{{ end }}
{{- end }}
{{- if $kindsListed }}
{{- if $root.Capabilities.APIVersions.Has (printf "%s/%s" $group $kind) }}true{{ end }}
{{- else if $root.Capabilities.APIVersions.Has $group }}true
{{- end }}
{{- else if eq $setting "true" }}true
{{- end }}
{{- end }}

{{- define "stepscope.podMonitorEnabled" -}}
{{- include "stepscope.operatorObjectEnabled" (list .Values.podMonitor.enabled . "PodMonitor") }}
{{- end }}

{{- define "stepscope.serviceMonitorEnabled" -}}
{{- $setting := toString .Values.serviceMonitor.enabled }}
{{- if and (eq $setting "true") (include "stepscope.podMonitorEnabled" .) }}
{{- fail "serviceMonitor.enabled and podMonitor.enabled are both true: choose one, or every target is scraped twice" }}
{{- end }}
{{- if not (and (eq $setting "auto") (include "stepscope.podMonitorEnabled" .)) }}
{{- include "stepscope.operatorObjectEnabled" (list .Values.serviceMonitor.enabled . "ServiceMonitor") }}
{{- end }}
{{- end }}

{{- define "stepscope.prometheusRuleEnabled" -}}
{{- include "stepscope.operatorObjectEnabled" (list .Values.prometheusRule.enabled . "PrometheusRule") }}
{{- end }}

{{/* Fails where the sharded layout's own shards scrape the exporters (sharding.shards.create) and a monitor
carries labels of the user's, (list setting labels $): the shards select the monitor by the chart's labels, so
extra ones only let another Prometheus select it too. kube-prometheus-stack's selects by `release` (the label the
install docs add): it scraped every exporter beside the shards and evaluated their rules again, the load sharding
is there to take off it, and every node alert came twice. */}}
{{- define "stepscope.checkShardedMonitorLabels" -}}
{{- $sharding := (index . 2).Values.sharding }}
{{- if and $sharding.enabled $sharding.shards.create (index . 1) }}
{{- fail (printf "%s %s with sharding.enabled: the chart's shards select the monitor by its own labels, and a Prometheus selecting it by these (kube-prometheus-stack's, by release) would scrape every exporter beside the shards, which sharding is there to avoid; leave %s empty" (index . 0) (toJson (index . 1)) (index . 0)) }}
{{- end }}
{{- end }}

{{/* Scrape relabeling shared by the ServiceMonitor and the PodMonitor: the node is the instance, and the
operator's target labels namespace, pod and container (the exporter's own pod) are dropped, so that the
training pod's namespace, pod and container the exporter publishes with pod attribution keep their names
(with honorLabels false they became exported_namespace, ... and the rules' joins on them matched nothing).
Called with the monitor's values (serviceMonitor or podMonitor). */}}
{{- define "stepscope.relabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_node_name]
  targetLabel: instance
  action: replace
- regex: namespace|pod|container
  action: labeldrop
{{- with .relabelings }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* A Prometheus duration (1m30s, 500ms) in milliseconds. */}}
{{- define "stepscope.durationMs" -}}
{{- $total := 0 }}
{{- $units := dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000 }}
{{- range regexFindAll "[0-9]+(ms|s|m|h)" . -1 }}
{{- $unit := regexFind "(ms|s|m|h)$" . }}
{{- $total = add $total (mul (trimSuffix $unit . | atoi) (get $units $unit)) }}
{{- end }}
{{- $total }}
{{- end }}

{{/* Fails when a monitor's scrapeTimeout is longer than its interval: Prometheus refuses the scrape config
and the operator drops the monitor without a word where users look. (list "serviceMonitor" values) */}}
{{- define "stepscope.checkScrapeTimeout" -}}
{{- $name := index . 0 }}
{{- $monitor := index . 1 }}
{{- if gt (include "stepscope.durationMs" $monitor.scrapeTimeout | atoi) (include "stepscope.durationMs" $monitor.interval | atoi) }}
{{- fail (printf "%s.scrapeTimeout %s is longer than %s.interval %s: Prometheus refuses such a scrape config, and the operator drops the monitor" $name $monitor.scrapeTimeout $name $monitor.interval) }}
{{- end }}
{{- end }}

{{/* Fails when a monitor scrapes less often than every 30 s (THRESHOLDS["scrape_interval_max_seconds"]): the rules'
1m windows need two scrapes in a minute. At 60 s Prometheus recorded no rate, share, straggler score nor verdict for
any run, and StepscopeRankLost paged every live rank (docs/deployment.md). (list "serviceMonitor" values) */}}
{{- define "stepscope.checkScrapeInterval" -}}
{{- $name := index . 0 }}
{{- $monitor := index . 1 }}
{{- if gt (include "stepscope.durationMs" $monitor.interval | atoi) 30000 }}
{{- fail (printf "%s.interval %s is longer than 30s: the stepscope rules' 1m windows need two scrapes in a minute; at 60s no run gets a rate, share or verdict and StepscopeRankLost pages every live rank (docs/deployment.md#scrape-and-evaluation-intervals)" $name $monitor.interval) }}
{{- end }}
{{- end }}

{{/* The groups of one of the rule files (a .Files.Glob), as YAML; fails clearly when the file is missing
or broken. (list $files path) */}}
{{- define "stepscope.ruleGroups" -}}
{{- $files := index . 0 }}
{{- $path := index . 1 }}
{{- $raw := $files.Get $path }}
{{- if not $raw }}
{{- fail (printf "%s is missing from the chart: run python -m grafana generate (or set prometheusRule.enabled=false)" $path) }}
{{- end }}
{{- $rules := fromYaml $raw }}
{{- if hasKey $rules "Error" }}
{{- fail (printf "%s is not valid YAML: %s" $path (get $rules "Error")) }}
{{- end }}
{{- toYaml (get $rules "groups") }}
{{- end }}

{{/* One PrometheusRule: (list $ name labelSources groups), labelSources a list of (list setting labels) that
stepscope.labelsWith puts on top of the chart's labels. */}}
{{- define "stepscope.prometheusRule" -}}
{{- $root := index . 0 }}
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: {{ index . 1 }}
  namespace: {{ include "stepscope.namespace" $root }}
  labels:
    {{- include "stepscope.labelsWith" (prepend (index . 2) $root) | nindent 4 }}
spec:
  groups:
    {{- toYaml (include "stepscope.alertRouting" (list $root (index . 3)) | fromYamlArray) | nindent 4 }}
{{- end }}

{{/* (list $ groups) -> the groups, their alerts labelled with the release namespace
(alerting.namespaceLabel: what kube-prometheus-stack and AlertmanagerConfig route on), the hints' severity
alerting.hintSeverity, and their dashboard links starting with alerting.grafanaUrl where it is set. */}}
{{- define "stepscope.alertRouting" -}}
{{- $alerting := (index . 0).Values.alerting }}
{{- $namespace := include "stepscope.namespace" (index . 0) }}
{{- $groups := index . 1 }}
{{- if has $alerting.hintSeverity (list "warning" "critical") }}
{{- fail (printf "alerting.hintSeverity %s would page the hints with the warnings and criticals: choose another (e.g. hint)" $alerting.hintSeverity) }}
{{- end }}
{{- range $group := $groups }}
{{- range $rule := $group.rules }}
{{- if hasKey $rule "alert" }}
{{- if $alerting.namespaceLabel }}
{{- $_ := set $rule "labels" (merge (dict "namespace" $namespace) ($rule.labels | default dict)) }}
{{- end }}
{{- if eq ($rule.labels | default dict).severity "info" }}
{{- $_ := set $rule.labels "severity" $alerting.hintSeverity }}
{{- end }}
{{- if and $alerting.grafanaUrl (hasKey ($rule.annotations | default dict) "dashboard_url") }}
{{- $_ := set $rule.annotations "dashboard_url" (replace "{{ $externalLabels.grafana_url }}" $alerting.grafanaUrl $rule.annotations.dashboard_url) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- toYaml $groups }}
{{- end }}

{{/* <fullname>-<suffix> in at most `max` characters: (list $ suffix max). Where it would be longer, the fullname
is cut and 6 hex characters of its sha256 follow, so the suffix (what tells a release's objects apart) stays
whole and two long release names that share their start still give two names. Cutting the whole name at 63 gave
a 53-character release's three dashboard ConfigMaps one name, and its shards, global Prometheus and exporter
Service one name too. */}}
{{- define "stepscope.componentName" -}}
{{- $fullname := include "stepscope.fullname" (index . 0) }}
{{- $suffix := index . 1 }}
{{- $max := index . 2 }}
{{- $name := printf "%s-%s" $fullname $suffix }}
{{- if gt (len $name) $max }}
{{- $name = printf "%s-%s-%s" ($fullname | trunc (int (sub $max (add (len $suffix) 8))) | trimSuffix "-") (sha256sum $fullname | trunc 6) $suffix }}
{{- end }}
{{- $name }}
{{- end }}

{{/* The dashboards' ConfigMap annotations: dashboards.folder under dashboards.folderAnnotation, which the Grafana
sidecar reads the folder from (without one the dashboards landed in General, not the documented folder
stepscope), and dashboards.annotations, which win. */}}
{{- define "stepscope.dashboardAnnotations" -}}
{{- $dashboards := .Values.dashboards }}
{{- $annotations := deepCopy ($dashboards.annotations | default dict) }}
{{- if $dashboards.folder }}
{{- $annotations = merge $annotations (dict $dashboards.folderAnnotation $dashboards.folder) }}
{{- end }}
{{- toYaml $annotations }}
{{- end }}

{{/* What of the exporter's pod Pod Security admission's baseline level refuses (host namespaces, host ports,
hostPath volumes, capabilities past its list), comma-separated; empty when none. The chart creates no namespace:
in one labelled baseline or restricted the DaemonSet renders and installs, and creates no pod ("violates
PodSecurity" in its events only), so the NOTES name these. Mirrors daemonset.yaml's conditions. */}}
{{- define "stepscope.baselineViolations" -}}
{{- $values := .Values }}
{{- $podResources := or $values.podResources.enabled (eq $values.gpuSource "dcgm") }}
{{- $found := list }}
{{- if $values.hostPID }}{{ $found = append $found "hostPID" }}{{ end }}
{{- if $values.hostNetwork }}{{ $found = append $found "hostNetwork" }}{{ end }}
{{- if or $values.hostNetwork (and $values.ingest.enabled $values.ingest.hostPort) }}{{ $found = append $found "hostPort" }}{{ end }}
{{- if $podResources }}{{ $found = append $found "hostPath (the kubelet's pod-resources socket), capabilities SYS_PTRACE and DAC_READ_SEARCH" }}{{ end }}
{{- if $values.hostRootfs.enabled }}{{ $found = append $found "hostPath (the node's /)" }}{{ end }}
{{- if and (include "stepscope.authStateFileEnabled" .) $values.webConfig.authStateFile.hostPath }}{{ $found = append $found "hostPath (webConfig.authStateFile)" }}{{ end }}
{{- join ", " $found }}
{{- end }}

{{/* "true" when the exporter runs as root, which Pod Security's restricted level refuses (runAsNonRoot). */}}
{{- define "stepscope.runsAsRoot" -}}
{{- $context := .Values.securityContext | default dict }}
{{- if or .Values.podResources.enabled (eq .Values.gpuSource "dcgm") (not $context.runAsNonRoot) (eq (toString $context.runAsUser) "0") }}true{{ end }}
{{- end }}

{{/* Prometheus objects of the sharded layout: names and the global layer's write URL. The Prometheus Operator
runs a Prometheus as StatefulSet prometheus-<name> (shards: prometheus-<name>-shard-<n>), and a StatefulSet's pods
are created only while its name has at most 52 characters (their controller-revision-hash label is the name and
11 characters more, and a label value has at most 63): 32 for the shards (up to 100 shards), 41 for the global
layer, whose name is also its Service's. */}}
{{- define "stepscope.shardsName" -}}
{{- include "stepscope.componentName" (list . "shards" 32) }}
{{- end }}

{{- define "stepscope.globalName" -}}
{{- include "stepscope.componentName" (list . "global" 41) }}
{{- end }}

{{/* The VictoriaMetrics operator names vmalert's Deployment and Service vmalert-<name>: a Service name has at
most 63 characters. */}}
{{- define "stepscope.vmalertName" -}}
{{- include "stepscope.componentName" (list . "vmalert" 55) }}
{{- end }}

{{/* The name of an object this release puts in `namespace`: (list $ name namespace). In another namespace than the
release's (an Alertmanager's), the release's namespace follows the name: releases of one name in two namespaces
(a team's stepscope each) put their Roles in the one Alertmanager namespace under one name, and the second install
failed on the first's Role ("exists and cannot be imported into the current release"). */}}
{{- define "stepscope.nameIn" -}}
{{- $root := index . 0 }}
{{- $home := include "stepscope.namespace" $root }}
{{- if eq (index . 2) $home }}{{ index . 1 }}{{ else }}{{ printf "%s-%s" (index . 1) $home }}{{ end }}
{{- end }}

{{- define "stepscope.prometheusServiceAccountName" -}}
{{- default (printf "%s-prometheus" (include "stepscope.fullname" .)) .Values.sharding.serviceAccountName }}
{{- end }}

{{- define "stepscope.remoteWriteURL" -}}
{{- if .Values.sharding.remoteWrite.url }}
{{- .Values.sharding.remoteWrite.url }}
{{- else if .Values.sharding.global.create }}
{{- printf "http://%s.%s.svc:9090/api/v1/write" (include "stepscope.globalName" .) (include "stepscope.namespace" .) }}
{{- else }}
{{- fail "sharding.remoteWrite.url is empty and sharding.global.create is false: say where the shards write" }}
{{- end }}
{{- end }}

{{/* Labels of the sharded layout's objects: not the exporter's selector labels, so that this chart's
Service and monitors never select a Prometheus. */}}
{{- define "stepscope.prometheusLabels" -}}
helm.sh/chart: {{ include "stepscope.chart" . }}
app.kubernetes.io/name: {{ include "stepscope.name" . }}-prometheus
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: prometheus
app.kubernetes.io/part-of: stepscope
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The exporter's web security (webConfig). "true" when a web config file is passed: the user's
(existingSecret) or one this chart generates from basicAuthUsers and tls. */}}
{{- define "stepscope.webConfigEnabled" -}}
{{- $web := .Values.webConfig }}
{{- if and $web.existingSecret $web.basicAuthUsers }}
{{- fail "webConfig.existingSecret and webConfig.basicAuthUsers are both set: put the users in the Secret's web config file, or leave existingSecret empty" }}
{{- end }}
{{- if or $web.existingSecret $web.basicAuthUsers $web.tls.existingSecret }}true{{ end }}
{{- end }}

{{/* "true" when basic auth may be on: the chart's users, or a file of the user's it cannot read. */}}
{{- define "stepscope.basicAuthPossible" -}}
{{- if or .Values.webConfig.existingSecret .Values.webConfig.basicAuthUsers }}true{{ end }}
{{- end }}

{{- define "stepscope.authStateFileEnabled" -}}
{{- if and .Values.webConfig.authStateFile.enabled (include "stepscope.basicAuthPossible" .) }}true{{ end }}
{{- end }}

{{- define "stepscope.webConfigSecretName" -}}
{{- default (printf "%s-web-config" (include "stepscope.fullname" .)) .Values.webConfig.existingSecret }}
{{- end }}

{{- define "stepscope.webConfigDir" -}}
/etc/stepscope/web
{{- end }}

{{- define "stepscope.tlsDir" -}}
/etc/stepscope/tls
{{- end }}

{{- define "stepscope.authStateDir" -}}
/var/lib/stepscope
{{- end }}

{{/* The web config file this chart generates (no existingSecret): basic auth users, the TLS Secret's files. */}}
{{- define "stepscope.generatedWebConfig" -}}
{{- $config := dict }}
{{- with .Values.webConfig.basicAuthUsers }}
{{- $_ := set $config "basic_auth_users" . }}
{{- end }}
{{- if .Values.webConfig.tls.existingSecret }}
{{- $tlsDir := include "stepscope.tlsDir" . }}
{{- $_ := set $config "tls_server_config" (dict "cert_file" (printf "%s/tls.crt" $tlsDir) "key_file" (printf "%s/tls.key" $tlsDir)) }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* What a ServiceMonitor endpoint or PodMonitor endpoint needs to scrape a secured exporter: scheme,
basicAuth (webConfig.scrapeCredentials) and tlsConfig. Fails when the chart's own users are on and the
monitor has no credentials to send, which would only show as every target down with 401. */}}
{{- define "stepscope.scrapeSecurity" -}}
{{- $web := .Values.webConfig }}
{{- $credentials := $web.scrapeCredentials }}
{{- if and $web.basicAuthUsers (not $credentials.existingSecret) }}
{{- fail "webConfig.basicAuthUsers is set but webConfig.scrapeCredentials.existingSecret is empty: the ServiceMonitor/PodMonitor would get 401; name the Secret holding the scraper's user and password" }}
{{- end }}
{{- if $web.tls.existingSecret }}
scheme: https
tlsConfig:
  ca:
    secret:
      name: {{ $web.tls.existingSecret }}
      key: {{ $web.tls.caKey }}
  serverName: {{ default (printf "%s.%s.svc" (include "stepscope.fullname" .) (include "stepscope.namespace" .)) $web.tls.serverName }}
  {{- if $web.tls.insecureSkipVerify }}
  insecureSkipVerify: true
  {{- end }}
{{- end }}
{{- with $credentials.existingSecret }}
basicAuth:
  username:
    name: {{ . }}
    key: {{ $credentials.usernameKey }}
  password:
    name: {{ . }}
    key: {{ $credentials.passwordKey }}
{{- end }}
{{- end }}

{{/* The receivers of (list $ RECEIVERS) as YAML, each Slack, e-mail and PagerDuty config given the fields of
files/notifications.yaml it does not set itself (the description, dashboard and runbook links, what to try). */}}
{{- define "stepscope.notifiedReceivers" -}}
{{- $texts := (index . 0).Files.Get "files/notifications.yaml" | fromYaml }}
{{- $receivers := list }}
{{- range (index . 1) }}
{{- $receiver := deepCopy . }}
{{- range $kind, $fields := $texts }}
{{- with (get $receiver $kind) }}
{{- $configs := list }}
{{- range . }}{{ $configs = append $configs (merge (deepCopy .) $fields) }}{{ end }}
{{- $_ := set $receiver $kind $configs }}
{{- end }}
{{- end }}
{{- $receivers = append $receivers $receiver }}
{{- end }}
{{- toYaml $receivers }}
{{- end }}
